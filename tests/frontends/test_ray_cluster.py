"""`loraplex serve --replicas 2 --ray-address HOST:PORT`: the application on a Ray cluster that is not the
launcher's (a head started here with `ray start --head`, token authentication on, as Ray starts clusters
from 2.59 on). A client without the cluster's token is told what to set. Stopped by SIGTERM, the launcher
has each replica drain its own server (it cannot signal processes on the cluster's nodes), so a running
stream finishes whole; then it deletes its own application only: another application on the cluster's
Ray Serve keeps running, and so does the cluster. (A module of its own: one Ray instance at a time.)"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

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


def test_a_stop_drains_through_the_replicas_and_leaves_the_clusters_other_applications(ray_head, tiny_served,
                                                                                          monkeypatch):
    address, env = ray_head
    model, adapters = tiny_served
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(k, env[k])
    before = _servers()
    s = RayServer("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                  "--kv-cache-memory-bytes", str(64 << 20), "--ray-address", address)
    servers = _servers() - before
    assert len(servers) == 2, servers          # the replicas' servers, on the cluster's workers
    _on_cluster(address, env, textwrap.dedent("""
        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class Other:
            def __call__(self, request):
                return "other"
        serve.run(Other.bind(), name="other", route_prefix="/other")
    """))
    stop_while_streaming(s, signal.SIGTERM)     # the stream finishes whole; the launcher exits 0
    # each replica drained its own server, and said so (how the launcher knows the servers are gone; Ray
    # Serve's own deletion would also wait for this 15 s stream, so the stream alone cannot tell)
    assert len([line for line in s.lines if "draining its server" in line]) == 2, "".join(s.lines[-30:])
    assert not [p for p in servers if Path(f"/proc/{p}").exists()], "a replica's server outlived the stop"
    status = _on_cluster(address, env, "s = serve.status().applications\n"
                                       "print(sorted(s), getattr(s['other'].status, 'value', s['other'].status))")
    assert status.split() == ["['other']", "RUNNING"], status
