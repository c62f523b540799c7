"""`loraplex serve --replicas 2` stopped by SIGTERM to every process of its session, as systemd stops a
service (its whole cgroup) and a superset of `kill -- -PGID`: Ray's GCS, raylet and workers get it too and
have it blocked (ray_launcher.start_ray), so Ray's proxy still carries the stream; the replicas' servers,
engines and frontends get it too and begin draining, and the launcher's own SIGTERM goes to each server's
launcher only (a second one would stop an engine at once). A stream running at the stop finishes whole, the
launcher exits 0, and nothing is left. Each of those three mends, and reading the replicas' pids before
ready, was needed for this to pass. (Ctrl-C, SIGINT to the group: test_ray_serve.py's module teardown. A
module of its own: one local Ray at a time.)"""
from __future__ import annotations

import signal

import pytest

pytest.importorskip("ray.serve")

from tests.frontends.test_ray_serve import RayServer, stop_while_streaming  # noqa: E402


def test_sigterm_to_every_process_drains_a_stream_and_leaves_nothing(tiny_served):
    model, adapters = tiny_served
    s = RayServer("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters),
                  "--kv-cache-memory-bytes", str(64 << 20))
    stop_while_streaming(s, signal.SIGTERM, everyone=True)
