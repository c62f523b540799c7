"""The Ray ingress's forwarding, against fake replica handles (no Ray cluster): a replica that dies after
its head but before its non-streamed body is complete is retried, and never answers with a cut body; a
stream cut mid-way ends with an error event."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from frontends.ray_app import HEADER, Ingress  # noqa: E402

JSON_HEAD = {"status": 200, "replica": "r0", "headers": {"Content-Type": "application/json"}}
SSE_HEAD = {"status": 200, "replica": "r1", "headers": {"Content-Type": "text/event-stream"}}


class ReplicaDied(RuntimeError):
    pass


class FakeReplicas:
    """Stands in for the replica deployment handle: each call answers with the next script (chunks, or an
    exception raised where it stands)."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.calls = 0

    def options(self, **_):
        return self

    def remote(self, *_):
        self.calls += 1
        return self._answer(self.scripts.pop(0))

    @staticmethod
    async def _answer(script):
        for item in script:
            if isinstance(item, Exception):
                raise item
            yield item


def forward(replicas: FakeReplicas):
    """-> (the response, the chunks of its body as sent)."""
    async def run():
        r = await Ingress.func_or_class(replicas, None).forward("POST", "/v1/completions", {}, b"{}", "tenant-a")
        chunks = [chunk async for chunk in r.body_iterator] if hasattr(r, "body_iterator") else [r.body]
        return r, chunks
    return asyncio.run(run())


def head(h: dict) -> bytes:
    return json.dumps(h).encode()


def test_a_non_streamed_answer_cut_by_a_dead_replica_is_retried_whole():
    whole = json.dumps({"choices": [{"text": "x" * 1000}]}).encode()
    replicas = FakeReplicas([head(JSON_HEAD), whole[:300], ReplicaDied()],
                            [head({**JSON_HEAD, "replica": "r1"}), whole[:500], whole[500:]])
    r, chunks = forward(replicas)
    assert replicas.calls == 2
    assert r.status_code == 200 and chunks == [whole] and r.headers[HEADER] == "r1"


def test_two_replicas_failing_mid_answer_give_a_503_not_a_cut_body():
    replicas = FakeReplicas([head(JSON_HEAD), b'{"choi', ReplicaDied()], [head(JSON_HEAD), ReplicaDied()])
    r, chunks = forward(replicas)
    assert r.status_code == 503 and json.loads(b"".join(chunks))["error"]["type"]


def test_a_stream_cut_mid_way_ends_with_an_error_event():
    replicas = FakeReplicas([head(SSE_HEAD), b'data: {"n": 1}\n\n', ReplicaDied()])
    r, chunks = forward(replicas)
    assert r.headers[HEADER] == "r1" and chunks[0] == b'data: {"n": 1}\n\n'
    assert "failed" in json.loads(chunks[-1][len(b"data: "):])["error"]["message"]
