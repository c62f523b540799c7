"""SIGHUP to `loraplex serve` reads the config file's [auth] table again (frontends/auth_reload.py): keys and
tenants change in every frontend without a restart; a table it refuses is named and the running keys stay;
a frontend restarted after a crash starts with the table in force. Tiny random Llama, two frontends."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import requests

from tests.frontends.server_fixture import Server, wait_until

BEFORE = '''
[auth]
admin_keys = ["sk-admin"]
[[auth.tenants]]
name = "old"
keys = ["sk-old"]
'''
AFTER = '''
[auth]
admin_keys = ["sk-admin"]
[[auth.tenants]]
name = "new"
keys = ["sk-new"]
requests_per_minute = 1
'''
REFUSED = AFTER + "quota = 3\n"


def test_sighup_reloads_the_keys_in_every_frontend_and_keeps_them_through_a_bad_table(tiny_served, tmp_path):
    model, adapters = tiny_served
    config = tmp_path / "loraplex.toml"
    config.write_text(BEFORE)
    s = Server("--model", str(model), "--dtype", "float32", "--frontends", "2", "--config", str(config),
               new_session=True)
    try:
        def status(key: str) -> int:      # a new connection each time: the port's two frontends take turns
            return requests.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {key}",
                                                                      "Connection": "close"},
                                 json={"model": "model", "prompt": "Hi", "max_tokens": 2}).status_code

        def everywhere(key: str, code: int) -> bool:
            return all(status(key) == code for _ in range(8))
        assert status("sk-old") == 200 and status("sk-new") == 401
        config.write_text(AFTER)
        os.kill(s.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: everywhere("sk-old", 401), timeout=30), "".join(s.lines[-20:])
        assert status("sk-new") == 200 and status("sk-new") == 429       # and its rate limit came with it
        config.write_text(REFUSED)
        os.kill(s.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: any("[auth] not reloaded" in line and "quota" in line for line in s.lines))
        assert everywhere("sk-old", 401) and everywhere("sk-admin", 200)
        frontend = s.info["frontend_pids"][0]
        os.kill(frontend, signal.SIGKILL)                # restarted by the launcher, from the table in force
        assert wait_until(lambda: "restarting it" in "".join(s.lines), timeout=30)
        assert wait_until(lambda: everywhere("sk-admin", 200) and everywhere("sk-old", 401), timeout=60)
        os.killpg(s.proc.pid, signal.SIGHUP)             # every process at once, as a closed terminal does
        assert wait_until(lambda: sum("[auth] not reloaded" in line for line in s.lines) == 2)
        assert everywhere("sk-admin", 200) and s.proc.poll() is None
        assert not [line for line in s.lines if "engine exited" in line], "the engine died of SIGHUP"
    finally:
        assert s.stop() == 0
    run_dir = Path(s.engine_address.removeprefix("ipc://")).parent       # where auth.json held the keys
    assert run_dir.name.startswith("loraplex-") and not run_dir.exists()


def test_without_a_config_file_sighup_still_stops_the_server(tiny_served):
    """Nothing to reload: a SIGHUP to the process group (a closed terminal) stops every process, as before."""
    model, _ = tiny_served
    s = Server("--model", str(model), "--dtype", "float32", "--frontends", "1", new_session=True)
    pids = [s.info["pid"], s.info["engine_pid"], *s.info["frontend_pids"]]
    os.killpg(s.proc.pid, signal.SIGHUP)
    assert s.proc.wait(60) == -signal.SIGHUP
    assert wait_until(lambda: not [p for p in pids if alive(p)], timeout=60)


def alive(pid: int) -> bool:
    """Running (a zombie not reaped yet is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
