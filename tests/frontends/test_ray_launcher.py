"""What each replica's server is started with: the application's own flags removed, paths absolute; which
processes the launcher waits for at the stop (a local Ray's own: every process below it)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from frontends.ray_launcher import descendants, replica_argv, wait_gone


def test_replica_argv_drops_the_application_flags_and_makes_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters").mkdir()
    argv = ["serve", "--replicas", "2", "--ray-address=10.0.0.1:6379", "--adapter-dir", "adapters", "--port", "8000",
            "--host", "0.0.0.0", "--frontends", "3", "--max-adapters-per-replica", "8", "--max-loras", "4",
            "--replica-routing", "random", "--replica-load-bound", "1.25", "--dtype", "float32"]
    assert replica_argv(argv) == ["--adapter-dir", os.path.join(str(tmp_path), "adapters"), "--max-loras", "4",
                                  "--dtype", "float32", "--replicas", "1"]


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_stop_waits_for_grandchildren_too():
    """A child that started a grandchild (as Ray's raylet starts its workers): both are found, and once
    found they are waited for even after the child is gone and the grandchild has another parent."""
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                              "'-c', 'import time; time.sleep(3)']); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while not (below := descendants(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(below) == 1, below
        grandchild = next(iter(below))
        found = descendants(os.getpid())            # other tests' servers may be below pytest too
        assert child.pid in found and grandchild in found, found
        child.kill()
        child.wait()
        assert grandchild not in descendants(os.getpid())      # reparented: no longer below us
        t = time.monotonic()
        assert wait_gone([child.pid, grandchild], 20) == []    # but still waited for, until it exits
        assert time.monotonic() - t > 1.0 and running(grandchild) is False
    finally:
        child.kill()
        child.wait()


def test_a_ray_address_where_nothing_listens_is_a_clear_error_at_once(tmp_path):
    """Not minutes of ray.init's retries and a traceback: one line naming the flag, at once."""
    import socket
    with socket.socket() as s:                 # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "frontends.cli", "serve", "--replicas", "2", "--port", "0",
                            "--ray-address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"loraplex: error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - start < 60


def test_the_launcher_waits_out_the_replicas_own_shutdown_timeout(monkeypatch):
    """`serve --replicas 2 --shutdown-timeout 300`: each replica's server drains for up to 300 s, so the
    launcher must not kill it earlier (it waited a fixed 90 s): its wait follows the flag."""
    from frontends import cli, ray_launcher
    seen = {}

    def fake(argv, replicas, *args):
        seen["timeout"] = args[-1]
        return 0
    monkeypatch.setattr(ray_launcher, "serve_on_ray", fake)
    assert cli.main(["serve", "--replicas", "2", "--shutdown-timeout", "300"]) == 0
    assert seen["timeout"] == 300 and ray_launcher.stop_wait_s(seen["timeout"]) > 300
    assert "--shutdown-timeout" in ray_launcher.replica_argv(["serve", "--replicas", "2", "--shutdown-timeout", "300"])


def test_ray_serve_gives_a_replica_it_stops_its_servers_shutdown_timeout(tmp_path):
    """A replica Ray Serve itself stops (`serve.delete`, a scale-down, a redeploy of `serve run
    frontends.ray_app:app_builder`) keeps its running requests as long as its server would on a SIGTERM:
    --shutdown-timeout (flag, --config file or default), not Ray's own 20 s."""
    from frontends.cli import serve_setting
    from frontends.ray_app import build_app
    config = tmp_path / "serve.toml"
    config.write_text("shutdown-timeout = 45\n")
    assert serve_setting(["--config", str(config)], "shutdown_timeout") == 45
    assert serve_setting([], "shutdown_timeout") == 30
    for args, want in ((["--shutdown-timeout", "75"], 75), (["--config", str(config)], 45)):
        engines = build_app(args, 2)._bound_deployment.init_args[0]._bound_deployment   # Ray Serve's own objects
        assert engines.name == "EngineReplica" and engines._deployment_config.graceful_shutdown_timeout_s == want


def test_a_cluster_stop_does_not_wait_for_a_replica_ray_serve_replaced(monkeypatch):
    """On --ray-address the launcher waits until Directory.undrained() is empty. A replica that died and was
    replaced stays registered until a fan-out finds it dead; it never says it is draining, so after
    DRAIN_ACK_S it no longer holds up the stop (it held it for the whole --shutdown-timeout + 60 s)."""
    from frontends import ray_replica
    clock = [1000.0]
    monkeypatch.setattr(ray_replica.time, "monotonic", lambda: clock[0])
    d = ray_replica.Directory.func_or_class()
    for name in ("live", "slow", "dead"):
        d.register(name, {"url": "http://127.0.0.1:1"})
    d.drain()
    assert d.is_draining() and d.is_stopping() and d.undrained() == ["dead", "live", "slow"]
    d.note_draining("live")
    d.note_draining("slow")
    clock[0] += ray_replica.DRAIN_ACK_S + 1
    assert d.undrained() == ["live", "slow"]        # both said they drain: waited for, however long it takes
    d.note_drained("live")
    assert d.undrained() == ["slow"]
    d.note_drained("slow")
    assert d.undrained() == []


def test_ray_passes_request_records_on_whole_beside_the_users_own_exemption(monkeypatch):
    """Ray's log deduplication must never fold away a record of --enable-log-requests; a pattern the user
    exempted stays exempt."""
    import re

    from frontends import ray_launcher
    record = '(ServeReplica pid=7) 2026-11-29 http-0 INFO {"request_id":"req_1","method":"POST"}'
    for own, other in ((None, None), ("^keep me", "keep me whole")):
        if own is None:
            monkeypatch.delenv("RAY_DEDUP_LOGS_ALLOW_REGEX", raising=False)
        else:
            monkeypatch.setenv("RAY_DEDUP_LOGS_ALLOW_REGEX", own)
        ray_launcher.keep_request_records()
        allow = re.compile(os.environ["RAY_DEDUP_LOGS_ALLOW_REGEX"])
        assert allow.search(record) and not allow.search("INFO -- CALL __call__ OK 5.0ms")
        assert other is None or allow.search(other)


def test_the_directory_sums_every_other_engines_rate_limit_charges():
    """Each replica gets the charges of every other engine, those of a restarted engine's earlier
    incarnation and of a replica gone since included; never its own."""
    from frontends import ray_replica
    d = ray_replica.Directory.func_or_class()
    assert d.exchange_charges("a", "a1", {"acme": {"requests_per_minute": 2.0}}) == {}
    assert d.exchange_charges("b", "b1", {"acme": {"requests_per_minute": 1.0}, "beta": {"tokens_per_minute": 50.0}}) \
        == {"acme": {"requests_per_minute": 2.0}}
    d.exchange_charges("a", "a2", {"acme": {"requests_per_minute": 5.0}})          # a's engine restarted
    assert d.exchange_charges("a", "a2", {"acme": {"requests_per_minute": 6.0}}) == {
        "acme": {"requests_per_minute": 3.0}, "beta": {"tokens_per_minute": 50.0}}
    assert d.exchange_charges("c", "c1", {}) == {"acme": {"requests_per_minute": 9.0},
                                                 "beta": {"tokens_per_minute": 50.0}}
