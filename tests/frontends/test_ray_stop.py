"""`loraplex serve --replicas 2` stopped by SIGTERM to its whole process group (`kill -- -PGID`), which reaches
Ray's GCS and raylet too: they have it blocked (ray_launcher.start_ray), so Ray's proxy still carries the
stream while the launcher drains the replicas' servers. A stream running at the stop finishes whole, the
launcher exits 0, and nothing is left. It failed without the mask (the raylet died at once, taking the proxy
and the stream). Then by SIGTERM to every process of the service, as systemd stops a cgroup: the replicas'
servers get it too and drain on their own, and no replica is replaced meanwhile (without the launcher's
word to the Directory, Ray Serve replaced each idle replica whose server had exited, and once, in a loaded
suite, the stop overran 150 s). Then by SIGTERM to the launcher alone, as a container runtime stops its first
process (the stream was cut when the launcher skipped its servers' drain). (Ctrl-C, SIGINT to the group:
test_ray_serve.py's module teardown. A module of its own: one local Ray at a time.)"""
from __future__ import annotations

import signal

import pytest

pytest.importorskip("ray.serve")

from tests.frontends.test_ray_serve import RayServer, stop_while_streaming  # noqa: E402


def test_sigterm_to_the_process_group_drains_a_stream_and_leaves_nothing(tiny_served):
    model, adapters = tiny_served
    s = RayServer("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                  "--kv-cache-memory-bytes", str(64 << 20))
    stop_while_streaming(s, signal.SIGTERM)


def test_sigterm_to_every_process_drains_a_stream_replaces_no_replica_and_leaves_nothing(tiny_served):
    model, adapters = tiny_served
    s = RayServer("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                  "--kv-cache-memory-bytes", str(64 << 20))
    stop_while_streaming(s, signal.SIGTERM, everyone=True)


def test_sigterm_to_the_launcher_alone_drains_a_stream_and_leaves_nothing(tiny_served):
    """A container runtime's stop: SIGTERM to the launcher (PID 1 of the container) and to nothing else. The
    launcher drains the replicas' servers itself, then stops Ray's processes."""
    model, adapters = tiny_served
    s = RayServer("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                  "--kv-cache-memory-bytes", str(64 << 20))
    stop_while_streaming(s, signal.SIGTERM, alone=True)
