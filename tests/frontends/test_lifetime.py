"""No process outlives `loraplex serve`, a second server is refused on a port the first one holds, and the
launcher's one JSON ready line says where everything is (frontends/lifetime.py, frontends/ready.py)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from frontends import ready
from frontends.lifetime import port_holder
from frontends.ray_launcher import _alive, _start_time, wait_gone
from tests.frontends.server_fixture import Server, wait_until


def test_the_ready_line_is_the_only_line_taken_for_ready():
    assert ready.parse('{"ready": true, "url": "http://h:1"}\n') == {"ready": True, "url": "http://h:1"}
    for line in ("loraplex: serving x at http://h:1/v1", '{"ready": false}', '{"ready": "yes"}', "{broken", "[1]"):
        assert ready.parse(line) is None, line
    seen = []
    assert ready.wait_for(["noise\n", '{"ready": true, "pid": 7}\n', "after\n"], seen.append) == {"ready": True,
                                                                                                 "pid": 7}
    assert seen == ["noise\n"]


def test_port_holder_names_the_listening_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_holder("127.0.0.1", port) is None          # bound, not listening: nobody answers
        s.listen()
        assert f"pid {os.getpid()} (" in port_holder("127.0.0.1", port)


def test_wait_gone_kills_what_outlives_its_bound():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert _alive(p.pid)
    started = _start_time(p.pid)
    assert started is not None and started == _start_time(p.pid) != _start_time(os.getpid())
    assert wait_gone([p.pid], 0.5) == [p.pid]
    assert p.wait(10) == -signal.SIGKILL and not _alive(p.pid) and _start_time(p.pid) is None


def test_every_process_dies_with_a_killed_launcher_and_the_port_is_refused_while_held(tiny_served):
    model, _ = tiny_served
    s = Server("--model", str(model), "--dtype", "float32", "--frontends", "2")
    info = s.info
    children = [info["engine_pid"], *info["frontend_pids"]]
    assert info["pid"] == s.proc.pid and len(info["frontend_pids"]) == 2 and info["url"] == s.url
    port = int(s.url.rsplit(":", 1)[1])
    second = subprocess.run([sys.executable, "-m", "frontends.cli", "serve", "--model", str(model), "--dtype",
                             "float32", "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert f"127.0.0.1:{port} is already served by pid" in second.stderr and "frontends.http_server" in second.stderr
    s.proc.send_signal(signal.SIGKILL)                        # as the OOM killer or a supervisor's timeout would
    s.proc.wait(10)
    assert wait_until(lambda: not any(_alive(p) for p in children), timeout=60), \
        [p for p in children if _alive(p)]
    assert port_holder("127.0.0.1", port) is None
