"""An adapter whose load has not landed stays LOADING: steps that do not use it run meanwhile, its pages
cannot be evicted, and its requests run once the load lands. The loader is held (a slow disk) to keep the
load in flight; on a GPU the copy on the side stream is the last part of a load (tests/engine/test_on_a_device.py
runs that branch)."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.lora.adapter_manager import AdapterState
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams


@pytest.fixture
def llm(adapter_dir):
    d, _ = adapter_dir
    llm = LLM(dtype="float32", max_loras=2, kv_cache_memory_bytes=64 << 20)
    llm.register_adapter("r16-attn", str(d / "r16-attn"))
    return llm


def test_a_load_in_flight_holds_up_nobody_and_cannot_be_evicted(llm):
    core = llm.engine
    core.adapters.loader.pause()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request(GenerateRequest("lora", [1, 2, 3, 4], params, adapter="r16-attn"))
    core.add_request(GenerateRequest("base", [1, 2, 3, 4], params))
    adapter = core.adapters.lookup("r16-attn")
    base_tokens = 0
    for _ in range(4):
        base_tokens += sum(len(o.new_token_ids) for o in core.step() if o.request_id == "base")
    assert adapter.state == AdapterState.LOADING and not adapter.future.done()
    assert base_tokens >= 3, "the base request decodes while the adapter's load is in flight"
    pages = list(adapter.pages)
    assert core.adapters.evict_idle(len(pages)) == 0            # its pages are a load's target: kept
    assert adapter.pages == pages and adapter.state == AdapterState.LOADING
    core.adapters.loader.resume()
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert adapter.state == AdapterState.RESIDENT
    lora_tokens = [t for o in outs if o.request_id == "lora" for t in o.new_token_ids]
    assert len(lora_tokens) == 6
    want = llm.generate([[1, 2, 3, 4]], params, adapter="r16-attn")[0].token_ids
    assert lora_tokens == want


def test_the_host_tier_holds_packed_pages_so_a_reload_is_one_copy(llm, monkeypatch):
    """Evicted from the pool, the adapter comes back from the host tier without being read or packed again;
    the host copy is pinned exactly when the pool is on a GPU (so the side stream copies it with no staging)."""
    import engine.lora.loader as loader
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate([[1, 2, 3, 4]], params, adapter="r16-attn")[0].token_ids
    adapters = llm.engine.adapters
    adapter = adapters.lookup("r16-attn")
    packed = adapters.host[adapter.adapter_id]
    assert packed.shape == (len(adapter.pages), adapters.page_elems)
    assert packed.is_pinned() == (adapters.storage.device.type == "cuda")
    n = len(adapter.pages)
    assert adapters.evict_idle(n) == n and adapter.state == AdapterState.DISK

    def no_repacking(*args):
        raise AssertionError("a load from the host tier packed the adapter again")
    monkeypatch.setattr(loader, "read_packed", no_repacking)
    assert llm.generate([[1, 2, 3, 4]], params, adapter="r16-attn")[0].token_ids == want
    assert adapter.state == AdapterState.RESIDENT and adapters.stats.host_hits >= 1
