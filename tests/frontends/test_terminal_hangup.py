"""A real terminal hang-up on `loraplex serve`: it runs on a pseudo-terminal it owns (the session leader, as
when it is started with `setsid -c`, or as a terminal's or an SSH session's own command), then the terminal
goes away (its master side closed). The kernel sends the launcher SIGHUP, and from then on every write to its
terminal fails. With --config the launcher reloads [auth] and goes on serving, its engine and frontends too;
without one it stops, and its engine and frontends with it (they follow their parent). Tiny random Llama.
(test_auth_reload.py sends SIGHUP to a process group, as a shell passes a hang-up on to its jobs.)"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import requests

from frontends import ready
from tests.frontends.server_fixture import wait_until
from tests.frontends.test_auth_reload import AFTER, BEFORE, alive

# after setsid (start_new_session), make the terminal on fd 0 this session's controlling terminal, then
# become the launcher: it is the session leader, to which the kernel sends the hang-up's SIGHUP
ON_TERMINAL = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
               "os.execv(sys.executable, [sys.executable, '-m', 'frontends.cli', *sys.argv[1:]])")


class TerminalServer:
    def __init__(self, *args: str):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen([sys.executable, "-c", ON_TERMINAL, "serve", "--port", "0", *args],
                                     stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.text = ""
        self.info: dict | None = None
        self.stop_reading = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        assert wait_until(lambda: self.info is not None or self.proc.poll() is not None, timeout=300), self.text
        assert self.info is not None, self.text

    def _read(self) -> None:
        while not self.stop_reading.is_set():
            if not select.select([self.master], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.text += chunk.decode(errors="replace")
            for line in self.text.replace("\r", "").splitlines():
                self.info = self.info or ready.parse(line)

    def hang_up(self) -> None:
        """The terminal goes away: its master side closed (the launcher's writes to it fail from now on)."""
        self.stop_reading.set()
        self.reader.join(5)
        os.close(self.master)

    def pids(self) -> list[int]:
        return [self.info["pid"], self.info["engine_pid"], *self.info["frontend_pids"]]


def completion(url: str, key: str) -> int:
    return requests.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                         json={"model": "model", "prompt": "Hi", "max_tokens": 2}, timeout=60).status_code


def test_a_terminal_hang_up_with_a_config_file_reloads_and_the_server_goes_on(tiny_served, tmp_path):
    model, _ = tiny_served
    config = tmp_path / "loraplex.toml"
    config.write_text(BEFORE)
    s = TerminalServer("--model", str(model), "--dtype", "float32", "--frontends", "2", "--config", str(config))
    try:
        url = s.info["url"]
        assert s.info["pid"] == s.proc.pid and completion(url, "sk-old") == 200
        config.write_text(AFTER)
        s.hang_up()
        assert wait_until(lambda: completion(url, "sk-old") == 401, timeout=60), "the hang-up did not reload [auth]"
        assert completion(url, "sk-new") == 200 and completion(url, "sk-new") == 429     # its rate limit too
        assert s.proc.poll() is None and all(alive(p) for p in s.pids())
        for _ in range(20):          # the engine's and frontends' output still goes through the launcher
            assert completion(url, "sk-admin") == 200
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "the launcher did not stop cleanly on a terminal that is gone"
    assert wait_until(lambda: not [p for p in s.pids() if alive(p)], timeout=60)
    assert not Path(s.info["engine_address"].removeprefix("ipc://")).parent.exists()


def test_a_terminal_hang_up_without_a_config_file_stops_the_server(tiny_served):
    model, _ = tiny_served
    s = TerminalServer("--model", str(model), "--dtype", "float32", "--frontends", "1")
    try:
        assert completion(s.info["url"], "none") == 200
        s.hang_up()
        assert s.proc.wait(60) == -signal.SIGHUP
        assert wait_until(lambda: not [p for p in s.pids() if alive(p)], timeout=60)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
