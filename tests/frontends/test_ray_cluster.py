"""`loraplex serve --replicas 2 --ray-address HOST:PORT`: the application on a Ray cluster that is not the
launcher's (a head started here with `ray start --head`, token authentication on, as Ray starts clusters
from 2.59 on). A client without the cluster's token is told what to set. Stopped by SIGTERM, the launcher
has each replica drain its own server (it cannot signal processes on the cluster's nodes), so a running
stream finishes whole; then it deletes its own application only: another application on the cluster's
Ray Serve keeps running, and so does the cluster. A replica that died earlier and that Ray Serve replaced
does not hold the stop up. (A module of its own: one Ray instance at a time.)"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from frontends.ray_launcher import stop_wait_s  # noqa: E402
from tests.frontends.server_fixture import wait_until  # noqa: E402
from tests.frontends.test_ray_serve import RayServer, stop_while_streaming  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of its own (token authentication, a token made here): -> (address, the clients' env)."""
    port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_DEDUP_LOGS="0")
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", "--num-cpus=4",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _on_cluster(address: str, env: dict, code: str) -> str:
    """Run `code` as a driver of the cluster (Serve imported as `serve`) -> what it printed."""
    script = f"import ray\nfrom ray import serve\nray.init(address={address!r}, log_to_driver=False)\n" + code
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _servers() -> set[str]:
    """The pids of the loraplex servers running here that replicas start."""
    return set(subprocess.run(["pgrep", "-f", "frontends.cli serve --host"], capture_output=True,
                              text=True).stdout.split())


def test_a_client_without_the_clusters_token_is_told_what_to_set(ray_head, tiny_served):
    address, env = ray_head
    model, adapters = tiny_served
    plain = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "-m", "frontends.cli", "serve", "--replicas", "2", "--port", "0",
                          "--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                          "--ray-address", address], env=plain, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert "RAY_AUTH_MODE=token" in out.stderr and "loraplex: error: --ray-address" in out.stderr, out.stderr[-2000:]


def test_a_stop_drains_through_the_replicas_even_after_one_was_replaced_and_leaves_other_applications(
        ray_head, tiny_served, monkeypatch):
    address, env = ray_head
    model, adapters = tiny_served
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(k, env[k])
    before = _servers()
    s = RayServer("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                  "--kv-cache-memory-bytes", str(64 << 20), "--ray-address", address)
    servers = _servers() - before
    assert len(servers) == 2, servers          # the replicas' servers, on the cluster's workers
    victim = _replace_a_replica(address, env, servers)
    servers = _servers() - before
    assert len(servers) == 2 and victim not in servers, servers
    _on_cluster(address, env, textwrap.dedent("""
        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Other:
            def __call__(self, request):
                return "other"
        serve.run(Other.bind(), name="other", route_prefix="/other")
    """))
    stopped_at = time.monotonic()
    stop_while_streaming(s, signal.SIGTERM)     # the stream finishes whole; the launcher exits 0
    # the dead replica, still registered, was not waited for: that wait was --shutdown-timeout + 60 s
    took = time.monotonic() - stopped_at
    assert not [line for line in s.lines if "still draining" in line], "".join(s.lines[-30:])
    assert took < stop_wait_s(30.0) / 2, f"the stop took {took:.0f} s"
    # each replica drained its own server, and said so (how the launcher knows the servers are gone; Ray
    # Serve's own deletion would also wait for this 15 s stream, so the stream alone cannot tell)
    assert len([line for line in s.lines if "draining its server" in line]) == 2, "".join(s.lines[-30:])
    assert not [p for p in servers if Path(f"/proc/{p}").exists()], "a replica's server outlived the stop"
    status = _on_cluster(address, env, "s = serve.status().applications\n"
                                       "print(sorted(s), getattr(s['other'].status, 'value', s['other'].status))")
    assert status.split() == ["['other']", "RUNNING"], status


def _directory_size(address: str, env: dict) -> int:
    return int(_on_cluster(address, env, "d = serve.get_deployment_handle('Directory', app_name='loraplex')\n"
                                         "print(len(d.all.remote().result(timeout_s=30)))"))


def _replace_a_replica(address: str, env: dict, servers: set[str]) -> str:
    """SIGKILL the Ray worker of one replica (its server, a child, gets SIGTERM: frontends/lifetime.py) and
    wait until Ray Serve has started a replacement that registered: the Directory then lists three
    replicas, the dead one still among them (no fan-out request has found it dead), as after a crash in a
    long-running service. -> the dead replica's server pid, once it has exited."""
    victim = sorted(servers)[0]
    worker = int(Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: not Path(f"/proc/{victim}").exists(), timeout=60), "the dead replica's server lived on"
    assert wait_until(lambda: _directory_size(address, env) == 3, timeout=180, every=2), \
        "no replacement replica registered beside the dead one"
    return victim
