"""Start a real `loraplex serve` (engine + frontends as processes) for tests and stop it after."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time


class Server:
    def __init__(self, *args: str, timeout: float = 600):
        self.proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(timeout):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))
        line = next(l for l in self.lines if "serving" in l)
        self.url = re.search(r"(http://\S+)/v1", line).group(1)
        self.engine_address = re.search(r"at (ipc://\S+)\)", line).group(1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "loraplex: serving" in line:
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
