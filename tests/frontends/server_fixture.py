"""Start a real `loraplex serve` (engine + frontends as processes) for tests and stop it after."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

from frontends import ready


class Server:
    def __init__(self, *args: str, timeout: float = 600, new_session: bool = False):
        """new_session: the server in a session (and process group) of its own, as a terminal would start it."""
        self.proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=new_session)
        self.lines: list[str] = []
        self.info: dict | None = None           # the launcher's ready line (frontends/ready.py)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(timeout):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        if self.info is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        self.url, self.engine_address = self.info["url"], self.info["engine_address"]
        self.engine_pid = self.info["engine_pid"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            info = ready.parse(line)
            if info is not None:
                self.info = info
                self.ready.set()
            if "loraplex: error" in line:
                self.ready.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def stub_server(*routes) -> tuple:
    """A stand-in HTTP server on a free local port serving `routes` ((method, path, handler), ...):
    (its aiohttp runner, to `cleanup()`; its URL)."""
    from aiohttp import web
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text output."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(?:\{\})?") + r" (\S+)"
    m = re.search(r"^" + pattern + "$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def wait_until(fn, timeout: float = 30, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(every)
    return False


def stream_running(url: str, body: dict) -> tuple[threading.Thread, list[bytes]]:
    """POST a streamed completion on a thread of its own; return once its first line has arrived, with the
    thread and the list its non-empty lines are appended to as they come."""
    import requests
    got: list[bytes] = []

    def read():
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            got.extend(line for line in r.iter_lines() if line)
    reader = threading.Thread(target=read)
    reader.start()
    # polled often: on a fast host a tiny model streams hundreds of tokens in 0.2 s (wait_until's default pace)
    assert wait_until(lambda: len(got) > 0, timeout=30, every=0.002), "the stream did not begin"
    return reader, got
