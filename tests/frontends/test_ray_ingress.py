"""The Ray ingress against fake replica handles (no Ray cluster): load-bounded adapter affinity; a replica
that dies after its head but before its non-streamed body is complete is retried, and never answers with
a cut body; a stream cut mid-way ends with an error event."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from frontends.ray_app import HEADER, Ingress, replica_load  # noqa: E402
from tests.frontends.server_fixture import stub_server  # noqa: E402

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


class RecordingReplicas(FakeReplicas):
    """Answers every call from `replica`, recording the multiplexed id it was routed with."""

    def __init__(self):
        super().__init__()
        self.ids: list[str] = []
        self.replica = "r0"

    def options(self, multiplexed_model_id: str = "", **_):
        self.ids.append(multiplexed_model_id)
        return self

    def remote(self, *_):
        return self._answer([head({**JSON_HEAD, "replica": self.replica}), b"{}"])


def test_replica_load_reads_running_and_waiting():
    text = ("# HELP loraplex_requests_running x\nloraplex_requests_running 3.0\nloraplex_requests_waiting 4.0\n"
            'loraplex_requests_total{adapter="a"} 99.0\n')
    assert replica_load(text) == 7.0


def test_affinity_holds_until_the_adapters_replica_carries_more_than_its_bound():
    replicas = RecordingReplicas()
    ingress = Ingress.func_or_class(replicas, None, "adapter", 1.25)
    ingress.base, ingress.poller = {"model"}, object()          # no directory lookups, no polling here

    def ask(load: dict, replica: str = "r0") -> str:
        ingress.load, replicas.replica = dict(load), replica
        asyncio.run(ingress.generate("POST", "/v1/completions", {}, b'{"model": "tenant-a"}'))
        return replicas.ids[-1]

    assert ask({"r0": 0, "r1": 0}) == "tenant-a" and ingress.where["tenant-a"] == "r0"
    assert ask({"r0": 10, "r1": 2}, replica="r1") == ""        # 10 > 1.25 x 6 + 1: sent to the less loaded
    assert ingress.where["tenant-a"] == "r0"                  # a spilled request does not move the affinity
    assert ask({"r0": 5, "r1": 4}) == "tenant-a"              # 5 <= 1.25 x 4.5 + 1: affinity again
    ingress.load_bound = 0
    assert ask({"r0": 100, "r1": 0}) == "tenant-a"            # bound 0: affinity whatever the load


def test_the_poller_reads_every_replicas_load_and_survives_a_failing_poll():
    ingress = Ingress.func_or_class(RecordingReplicas(), None, "adapter", 1.25)
    answers = [RuntimeError("directory unreachable"),
               [("r0", 200, b"loraplex_requests_running 6.0\nloraplex_requests_waiting 2.0\n"),
                ("r1", 200, b"loraplex_requests_running 1.0\n"), ("r2", 503, b"{}")]]

    async def fake_each(*_, forget=True, timeout=None):
        assert not forget, "a failed poll must not drop a replica from the Directory"
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run():
        ingress._each = fake_each
        task = asyncio.create_task(ingress._poll_loads())
        for _ in range(100):
            if not answers:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        task.cancel()
    asyncio.run(run())
    assert ingress.load == {"r0": 8.0, "r1": 1.0}          # the replica that answered 503 is left out
    assert ingress.overloaded("r0") and not ingress.overloaded("r1")


class FakeDirectory:
    """The Directory deployment's handle: replica name -> its URL; records what it is told to forget."""

    def __init__(self, urls: dict[str, str]):
        self.urls, self.forgotten, self.runtime = urls, [], {}
        self.all = self._Method(lambda: {n: {"url": u} for n, u in self.urls.items()})
        self.forget = self._Method(self.forgotten.append)
        self.note_load = self._Method(self.runtime.__setitem__)
        self.note_unload = self._Method(lambda name: self.runtime.pop(name, None))

    class _Method:
        def __init__(self, fn):
            self.fn = fn

        async def remote(self, *args):
            return self.fn(*args)


async def stub_replica(metrics_handler):
    """A replica stand-in serving only /metrics on a free port: (its runner, its URL)."""
    return await stub_server(("GET", "/metrics", metrics_handler))


def test_a_hung_replica_is_left_out_of_a_poll_in_time_and_not_forgotten(monkeypatch):
    from aiohttp import web

    import frontends.ray_app as ray_app
    monkeypatch.setattr(ray_app, "POLL_TIMEOUT_S", 0.5)

    async def fast(request):
        return web.Response(text="loraplex_requests_running 2.0\nloraplex_requests_waiting 1.0\n")

    async def hung(request):
        await asyncio.sleep(3)
        return web.Response(text="")

    async def run():
        runners, urls = [], {}
        for name, handler in (("r0", fast), ("r1", hung)):
            runner, urls[name] = await stub_replica(handler)
            runners.append(runner)
        directory = FakeDirectory(urls)
        ingress = Ingress.func_or_class(RecordingReplicas(), directory, "adapter", 1.25)
        task = asyncio.create_task(ingress._poll_loads())
        start = asyncio.get_running_loop().time()
        while not ingress.load and asyncio.get_running_loop().time() - start < 10:
            await asyncio.sleep(0.05)
        took = asyncio.get_running_loop().time() - start
        task.cancel()
        await ingress.session.close()
        for runner in runners:
            await runner.cleanup()
        return ingress.load, took, directory.forgotten
    load, took, forgotten = asyncio.run(run())
    assert load == {"r0": 3.0} and took < 3, (load, took)     # within the poll timeout, not the session's 300 s
    assert forgotten == []


def test_the_ingress_metrics_are_behind_the_replicas_keys():
    """The ingress passes the caller's key to every replica's /metrics: refused by them, refused here."""
    from aiohttp import web

    async def keyed(request):
        if request.headers.get("Authorization") != "Bearer sk-admin":
            return web.json_response({"error": {"message": "/metrics needs an admin key"}}, status=401)
        return web.Response(text="loraplex_requests_running 2.0\n")

    async def run():
        runner, url = await stub_replica(keyed)
        ingress = Ingress.func_or_class(RecordingReplicas(), FakeDirectory({"r0": url}), "adapter", 0)
        refused = await ingress.metrics({})
        allowed = await ingress.metrics({"Authorization": "Bearer sk-admin"})
        await ingress.session.close()
        await runner.cleanup()
        return refused, allowed
    refused, allowed = asyncio.run(run())
    assert refused.status_code == 401 and b"admin key" in refused.body
    assert allowed.status_code == 200 and b'loraplex_requests_running{replica="r0"} 2.0' in allowed.body


def test_the_load_poll_carries_the_key_the_replicas_let_read_metrics():
    """With keys configured on the replicas, the poll reads their loads with the ingress's own key (the
    replica's check is the server's: Auth.metrics_access with that key in its environment)."""
    from aiohttp import web

    from frontends.auth import parse_auth
    auth = parse_auth({"admin_keys": ["sk-admin"]}, ingress_key="sk-ingress-test")

    async def guarded(request):
        status = auth.metrics_access(request.headers.get("Authorization", ""))
        if status != 200:
            return web.json_response({"error": {"message": "refused"}}, status=status)
        return web.Response(text="loraplex_requests_running 4.0\nloraplex_requests_waiting 1.0\n")

    async def poll(key):
        runner, url = await stub_replica(guarded)
        ingress = Ingress.func_or_class(RecordingReplicas(), FakeDirectory({"r0": url}), "adapter", 1.25, key)
        task = asyncio.create_task(ingress._poll_loads())
        await asyncio.sleep(0.5)
        task.cancel()
        await ingress.session.close()
        await runner.cleanup()
        return ingress.load
    assert asyncio.run(poll("sk-ingress-test")) == {"r0": 5.0}
    assert asyncio.run(poll(None)) == {}         # without it the replicas refuse: no load is known


async def adapter_replica(refuse: set[str]):
    """A replica stand-in with load / unload routes: it refuses to load the names in `refuse`. -> (runner,
    URL, the names it holds)."""
    from aiohttp import web
    held: set[str] = set()

    async def load(request):
        name = (await request.json())["lora_name"]
        if name in refuse:
            return web.json_response({"error": {"message": f"adapter: {name} has NaN weights"}}, status=400)
        held.add(name)
        return web.json_response({"status": "ok"})

    async def unload(request):
        name = (await request.json())["lora_name"]
        if name not in held:
            return web.json_response({"error": {"message": f"no adapter {name}"}}, status=404)
        held.discard(name)
        return web.json_response({"status": "ok"})
    runner, url = await stub_server(("POST", "/v1/load_lora_adapter", load),
                                    ("POST", "/v1/unload_lora_adapter", unload))
    return runner, url, held


def test_a_load_is_all_or_nothing_and_noted_for_replicas_started_later():
    """Refused by one replica, a load is undone on the others and the answer names the replica and why; taken
    by all, it is noted in the Directory (a replacement replica loads it before it serves); an unload
    forgets it, a replica that never had it counting as done."""
    async def run():
        (ra, ua, held_a), (rb, ub, held_b) = await adapter_replica(set()), await adapter_replica({"bad"})
        directory = FakeDirectory({"r0": ua, "r1": ub})
        ingress = Ingress.func_or_class(RecordingReplicas(), directory, "adapter", 0)

        async def post(path, name):
            body = json.dumps({"lora_name": name, "lora_path": f"/a/{name}"}).encode()
            return await ingress.everywhere("POST", path, {}, body)
        bad = await post("/v1/load_lora_adapter", "bad")
        after_bad = (set(held_a), set(held_b), dict(directory.runtime))
        good = await post("/v1/load_lora_adapter", "good")
        after_good = (set(held_a), set(held_b), dict(directory.runtime))
        held_b.discard("good")                               # as if r1 had been replaced before the unload
        gone = await post("/v1/unload_lora_adapter", "good")
        after_unload = (set(held_a), set(held_b), dict(directory.runtime))
        await ingress.session.close()
        for r in (ra, rb):
            await r.cleanup()
        return bad, after_bad, good, after_good, gone, after_unload
    bad, after_bad, good, after_good, gone, after_unload = asyncio.run(run())
    assert bad.status_code == 400
    assert b"replica r1 refused it: adapter: bad has NaN weights; undone on r0" in bad.body
    assert after_bad == (set(), set(), {})                  # nowhere, and not noted
    assert good.status_code == 200 and after_good[:2] == ({"good"}, {"good"})
    assert after_good[2] == {"good": {"lora_name": "good", "lora_path": "/a/good"}}
    assert gone.status_code == 200 and after_unload == (set(), set(), {})
