"""A tenant's rate limits hold across `loraplex serve --replicas 2` (frontends/ray_replica.py shares each
engine's charges through the Directory twice a second, RATE_SYNC_S): its requests, spread over both replicas, are let in
one minute's worth in all, not one each. Tiny random Llama on a local Ray instance."""
from __future__ import annotations

import signal
import time

import pytest
import requests

from tests.frontends.test_ray_serve import RayServer

pytest.importorskip("ray.serve")

CONFIG = '''
[auth]
admin_keys = ["sk-admin"]
[[auth.tenants]]
name = "acme"
keys = ["sk-acme"]
requests_per_minute = 3
'''


def test_a_tenants_requests_per_minute_hold_across_two_replicas(tiny_served, tmp_path):
    model, _ = tiny_served
    config = tmp_path / "loraplex.toml"
    config.write_text(CONFIG)
    s = RayServer("--model", str(model), "--dtype", "float32", "--config", str(config),
                  "--kv-cache-memory-bytes", str(64 << 20))
    try:
        answers = []                     # (status, replica); spaced out so that the replicas exchange between
        for _ in range(12):              # (3 a minute refill one request in 20 s: none comes back in this run)
            r = requests.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                              json={"model": "model", "prompt": "Hi", "max_tokens": 2}, timeout=60)
            answers.append((r.status_code, r.headers.get("x-loraplex-replica")))
            time.sleep(1.5)
        assert {status for status, _ in answers} == {200, 429}, answers
        assert len({replica for _, replica in answers}) == 2, f"one replica answered them all: {answers}"
        assert sum(status == 200 for status, _ in answers) == 3, answers      # each replica alone would allow 3
    finally:
        assert s.stop(signal.SIGTERM) == 0
    assert not s.left(), s.left()
