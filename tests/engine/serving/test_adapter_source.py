"""The remote adapter store (engine/serving/adapter_source.py) against a real HTTP server on loopback:
files fetched whole into the cache, `{name}` URLs, the bearer token, a missing adapter remembered for a
while, cut and oversized downloads refused with nothing cached; and requests held while their adapter
arrives (engine/serving/adapter_fetches.py)."""
from __future__ import annotations

import asyncio
import json
import struct

import pytest
from aiohttp import web

from engine.serving.adapter_fetches import AdapterFetches
from engine.serving.adapter_source import AdapterSource, FetchRefused, hub_url
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams
from tests.frontends.server_fixture import stub_server


def safetensors_bytes(n_floats: int = 4) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)


class Store:
    """Adapters under /store/<name>/: `files` maps a name to its two files' bytes; `gate` holds every
    answer until set; `seen` lists the paths asked for and the Authorization header each came with."""

    def __init__(self):
        self.files: dict[str, dict[str, bytes]] = {}
        self.seen: list[tuple[str, str | None]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization")))
        await self.gate.wait()
        name, file = request.match_info["name"], request.match_info["file"]
        body = self.files.get(name, {}).get(file)
        return web.Response(status=404) if body is None else web.Response(body=body)

    def add(self, name: str, weights: bytes | None = None) -> None:
        self.files[name] = {"adapter_config.json": b'{"r": 4, "peft_type": "LORA"}',
                            "adapter_model.safetensors": weights if weights is not None else safetensors_bytes()}


@pytest.fixture
async def store():
    s = Store()
    runner, url = await stub_server(("GET", "/store/{name}/{file}", s.handle),
                                    ("GET", "/hub/{name}/x/{file}", s.handle),
                                    ("GET", "/org/{name}/resolve/main/{file}", s.handle))
    yield s, url
    await runner.cleanup()


async def test_an_adapter_is_fetched_whole_into_the_cache(store, tmp_path):
    s, url = store
    s.add("tenant-a")
    source = AdapterSource(f"{url}/store", tmp_path, token="sk-store")
    path = await source.fetch("tenant-a")
    assert path == tmp_path / "tenant-a" and source.cached("tenant-a") == path
    assert {f.name: f.read_bytes() for f in path.iterdir()} == s.files["tenant-a"]
    assert [p for p, _ in s.seen] == ["/store/tenant-a/adapter_config.json",
                                      "/store/tenant-a/adapter_model.safetensors"]
    assert {auth for _, auth in s.seen} == {"Bearer sk-store"}
    assert [p.name for p in tmp_path.iterdir()] == ["tenant-a"]            # no partial folder left
    hub = AdapterSource(f"{url}/hub/{{name}}/x", tmp_path / "hub")
    assert (await hub.fetch("tenant-a")).name == "tenant-a"
    assert s.seen[-1] == ("/hub/tenant-a/x/adapter_model.safetensors", None)
    await source.close()
    await hub.close()


async def test_a_missing_adapter_is_a_refusal_remembered_for_a_while(store, tmp_path):
    s, url = store
    source = AdapterSource(f"{url}/store", tmp_path, retry_after_s=0.3)
    with pytest.raises(FetchRefused, match=r"adapter 'nope' is not available: .*/store/nope/adapter_config.json "
                                           r"answered HTTP 404"):
        await source.fetch("nope")
    assert source.refusal("nope") and len(s.seen) == 1
    await asyncio.sleep(0.35)
    assert source.refusal("nope") is None                   # asked again after retry_after_s
    s.add("nope")
    assert await source.fetch("nope") == tmp_path / "nope"
    await source.close()


@pytest.mark.parametrize("weights, says", [
    (safetensors_bytes()[:-3], "cut short"),
    (b"not a safetensors file at all", "not a safetensors file"),
    (safetensors_bytes(4096), "over the limit of 1000 bytes"),
])
async def test_bad_or_oversized_weights_are_refused_and_nothing_is_cached(store, tmp_path, weights, says):
    s, url = store
    s.add("bad", weights)
    source = AdapterSource(f"{url}/store", tmp_path, max_bytes=1000)
    with pytest.raises(FetchRefused, match=says):
        await source.fetch("bad")
    assert list(tmp_path.iterdir()) == [] and source.cached("bad") is None and says in source.refusal("bad")
    await source.close()


async def test_a_redirect_elsewhere_is_followed_without_the_token(store, tmp_path):
    """As the Hugging Face Hub answers a resolve URL: a redirect to its CDN, which must not get the token."""
    s, url = store
    s.add("tenant-b")
    cdn, cdn_url = await stub_server(("GET", "/store/{name}/{file}", s.handle))    # another origin

    async def moved(request: web.Request) -> web.Response:
        s.seen.append((request.path, request.headers.get("Authorization")))
        raise web.HTTPFound(f"{cdn_url}/store/{request.match_info['name']}/{request.match_info['file']}")
    hub, hub_url = await stub_server(("GET", "/{name}/resolve/main/{file}", moved))
    source = AdapterSource(f"{hub_url}/{{name}}/resolve/main", tmp_path, token="hf_secret")
    assert (await source.fetch("tenant-b")).name == "tenant-b"
    assert s.seen == [("/tenant-b/resolve/main/adapter_config.json", "Bearer hf_secret"),
                      ("/store/tenant-b/adapter_config.json", None),
                      ("/tenant-b/resolve/main/adapter_model.safetensors", "Bearer hf_secret"),
                      ("/store/tenant-b/adapter_model.safetensors", None)]
    await source.close()
    await hub.cleanup()
    await cdn.cleanup()


async def test_a_hub_source_names_an_organization(store, tmp_path):
    s, url = store
    s.add("tenant-c")
    assert hub_url("hf://my-org", "https://huggingface.co") == "https://huggingface.co/my-org/{name}/resolve/main"
    assert hub_url("hf://my-org@v2", "https://h") == "https://h/my-org/{name}/resolve/v2"
    with pytest.raises(ValueError, match="hf://ORG"):
        hub_url("hf://org/repo", "https://h")
    source = AdapterSource(hub_url("hf://org", url), tmp_path)            # the stub as HF_ENDPOINT
    assert (await source.fetch("tenant-c")).name == "tenant-c"
    assert s.seen[-1][0] == "/org/tenant-c/resolve/main/adapter_model.safetensors"
    await source.close()


def test_only_http_urls_and_valid_names():
    with pytest.raises(ValueError, match="not an http"):
        AdapterSource("file:///etc", "/tmp")
    with pytest.raises(ValueError):
        AdapterSource("http://h/s", "/tmp").file_url("../etc", "adapter_config.json")


def request(rid: str, adapter: str | None) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2], SamplingParams(max_tokens=2), adapter=adapter)


async def test_requests_wait_for_their_adapter_and_share_its_fetch(store, tmp_path):
    s, url = store
    s.add("a")
    back, refused = [], []

    async def refuse(identity, rid, error, status):
        refused.append((rid, status, error))
    fetches = AdapterFetches(AdapterSource(f"{url}/store", tmp_path), known=lambda n: n == "local",
                             requeue=lambda identity, req: back.append(req.request_id), refuse=refuse)
    s.gate.clear()
    assert not fetches.holds(b"f", request("base", None)) and not fetches.holds(b"f", request("l", "local"))
    assert fetches.holds(b"f", request("r1", "a")) and fetches.holds(b"f", request("r2", "a"))
    assert fetches.holds(b"f", request("r3", "missing")) and fetches.holds(b"f", request("gone", "a"))
    assert fetches.fetching() == 2 and fetches.abort("gone", b"f") and not fetches.abort("r1", b"other")
    await asyncio.sleep(0.1)
    assert back == [] and refused == []                     # held while the store answers nothing
    s.gate.set()
    for _ in range(100):
        if not fetches.tasks:
            break
        await asyncio.sleep(0.02)
    assert sorted(back) == ["r1", "r2"] and [(r, st) for r, st, _ in refused] == [("r3", 404)]
    assert len([p for p, _ in s.seen if p.startswith("/store/a/")]) == 2      # one fetch for both
    assert not fetches.holds(b"f", request("r4", "a"))      # cached now: not held
    assert not fetches.holds(b"f", request("r5", "missing"))     # refused lately: the engine says why at once
    await fetches.source.close()


def test_the_token_a_source_sends(monkeypatch):
    from engine import envs
    monkeypatch.delenv("LORAPLEX_ADAPTER_SOURCE_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert envs.adapter_source_token(hub=True) == "hf_x" and envs.adapter_source_token() is None
    monkeypatch.setenv("LORAPLEX_ADAPTER_SOURCE_TOKEN", "sk-store")
    assert envs.adapter_source_token(hub=True) == envs.adapter_source_token() == "sk-store"
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example/")
    assert envs.hf_endpoint() == "https://hub.example"
