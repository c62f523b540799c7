"""Adapters known by content (engine/lora/digest.py): names of one content share one adapter (its pages,
host copy and prefix cache); a name re-registered with other content never gets the old content's pages
or KV blocks, with the prefix cache warm."""
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from engine.config import LoraConfig
from engine.llm import LLM
from engine.lora.adapter_manager import AdapterManager, AdapterState
from engine.lora.digest import content_digest
from engine.page_pool import PagePool
from ipc.sampling_params import SamplingParams
from tests.engine.lora.synthetic import TINY, write_adapter
from tests.frontends.server_fixture import wait_until

PAGE = 512


def manager(num_pages):
    pool = PagePool(num_pages)
    return AdapterManager(LoraConfig(), TINY, pool, torch.zeros(num_pages, PAGE)), pool


def test_the_digest_is_the_content_not_the_folder(tmp_path):
    a = write_adapter(tmp_path / "a", r=4, seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "somewhere/else"               # metadata only
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    assert content_digest(a) == content_digest(copy) and content_digest(a).startswith("sha256:")
    other = write_adapter(tmp_path / "other", r=4, seed=2)           # other weights
    assert content_digest(other) != content_digest(a)
    alpha = tmp_path / "alpha"
    shutil.copytree(a, alpha)
    cfg["lora_alpha"] = cfg.get("lora_alpha", 4) * 2                  # same weights, another scale
    (alpha / "adapter_config.json").write_text(json.dumps(cfg))
    assert content_digest(alpha) != content_digest(a)


def test_two_names_of_one_content_use_the_pages_once(tmp_path):
    m, pool = manager(64)
    src = write_adapter(tmp_path / "a", r=4, seed=1)
    shutil.copytree(src, tmp_path / "b")
    a, b = m.register("a", src), m.register("b", tmp_path / "b")
    assert a is b and a.names == {"a", "b"} and m.names() == ["a", "b"]
    assert m.start_load(a)
    m.wait_loads()
    assert not m.poll() and a.state == AdapterState.RESIDENT
    assert pool.usage()["adapter"] == len(a.pages) == a.layout.num_pages(PAGE)
    m.unregister("a")                                    # the other name keeps it, resident
    assert m.lookup("b") is a and a.state == AdapterState.RESIDENT and not a.unregistering
    m.unregister("b")
    assert pool.usage()["adapter"] == 0 and not m.by_key


def test_a_new_content_is_hashed_in_the_background_not_on_the_cold_path(tmp_path, monkeypatch):
    """Hashing a 39 MB adapter costs three times its cold load: a registration hashes only when an adapter
    of the same shape is registered already (and the server not even then)."""
    from engine.lora import adapter_manager
    hashed = []

    def spy(path, pace=None):
        hashed.append((Path(path).name, threading.current_thread() is threading.main_thread()))
        return content_digest(path, pace)
    monkeypatch.setattr(adapter_manager, "content_digest", spy)
    m, _ = manager(64)
    a = m.register("a", write_adapter(tmp_path / "a", r=4, seed=1))
    b = m.register("b", write_adapter(tmp_path / "b", r=8, seed=1))          # another shape
    assert wait_until(lambda: a.digest and b.digest, timeout=10)
    assert sorted(hashed) == [("a", False), ("b", False)] and a.digest != b.digest
    m.close()


def test_the_server_merges_twins_once_the_background_digests_know_them(tmp_path):
    """hash_now=False (the server): a copy of a registered adapter is registered apart, nothing hashed on
    the engine thread; once both digests are in, the next poll makes them one adapter: the resident one
    keeps both names, the other's pages are never taken."""
    m, pool = manager(64)
    src = write_adapter(tmp_path / "a", r=4, seed=1)
    a = m.register("a", src, hash_now=False)
    assert m.start_load(a)
    m.wait_loads()
    shutil.copytree(src, tmp_path / "b")
    b = m.register("b", tmp_path / "b", hash_now=False)
    assert b is not a and m.lookup("b") is b
    assert wait_until(lambda: a.digest and b.digest, timeout=10) and a.digest == b.digest
    m.poll()
    assert m.lookup("b") is a and a.names == {"a", "b"} and b.unregistering and b.adapter_id not in m.by_id
    assert pool.usage()["adapter"] == len(a.pages) and a.state == AdapterState.RESIDENT
    other = m.register("c", write_adapter(tmp_path / "c", r=4, seed=2), hash_now=False)   # a twin in shape only
    assert wait_until(lambda: other.digest, timeout=10)
    m.poll()
    assert m.lookup("c") is other and other.digest != a.digest
    m.close()


def test_background_digests_read_at_full_speed_only_while_the_engine_is_idle(tmp_path, monkeypatch):
    from engine.lora import adapter_manager, digest
    monkeypatch.setattr(digest, "CHUNK", 4096)
    rests = []
    monkeypatch.setattr(adapter_manager.time, "sleep", lambda s: rests.append(s))
    m, _ = manager(64)
    m.idle.set()
    m._rest_unless_idle()
    assert rests == []                                   # idle, nothing loading: no rest
    m.idle.clear()                                       # a step runs
    f = write_adapter(tmp_path / "a", r=4, seed=1)
    content_digest(f, pace=m._rest_unless_idle)
    chunks = -(-(f / "adapter_model.safetensors").stat().st_size // 4096)
    assert rests == [adapter_manager.BUSY_REST_S] * chunks
    m.close()
    with pytest.raises(adapter_manager._Closed):         # closed: a digest in progress stops
        m._rest_unless_idle()


def test_re_registering_a_name(tmp_path):
    m, _ = manager(64)
    first = m.register("a", write_adapter(tmp_path / "a1", r=4, seed=1))
    assert m.register("a", tmp_path / "a1") is first                  # same content: nothing changes
    second = m.register("a", write_adapter(tmp_path / "a2", r=4, seed=2))
    assert second is not first and second.adapter_id != first.adapter_id and first.unregistering
    assert m.lookup("a") is second


PROMPT = ("Paris is the capital of France, Rome the capital of Italy, Madrid the capital of Spain, Lisbon the "
          "capital of Portugal, Berlin the capital of Germany, Vienna the capital of Austria, and the capital of "
          "Belgium is")                                      # longer than a KV block: its blocks are cached


def run(llm, adapter):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), adapter=adapter)[0]
    return out.token_ids, out.num_cached_tokens


@pytest.fixture(scope="module")
def reference(adapter_dir):
    """Each fidelity adapter's greedy tokens for PROMPT from an engine without prefix caching."""
    src, _ = adapter_dir
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    out = {}
    for name in ("r4-qv", "r8-all"):
        llm.register_adapter(name, str(src / name))
        out[name] = run(llm, name)[0]
    llm.close()
    return out


def test_a_name_re_loaded_with_new_content_gets_the_new_tokens_with_the_cache_warm(adapter_dir, tmp_path, reference):
    src, _ = adapter_dir
    assert reference["r4-qv"] != reference["r8-all"]
    llm = LLM(dtype="float32")
    shutil.copytree(src / "r4-qv", tmp_path / "v1")
    shutil.copytree(src / "r8-all", tmp_path / "v2")
    llm.register_adapter("x", str(tmp_path / "v1"))
    assert run(llm, "x")[0] == reference["r4-qv"]
    tokens, cached = run(llm, "x")
    assert tokens == reference["r4-qv"] and cached > 0                 # the prefix cache holds PROMPT for v1
    llm.register_adapter("x", str(tmp_path / "v2"))                     # same name, new content
    tokens, cached = run(llm, "x")
    assert tokens == reference["r8-all"] and cached == 0                # none of v1's KV blocks
    tokens, cached = run(llm, "x")
    assert tokens == reference["r8-all"] and cached > 0                 # v2's own blocks now


def test_two_names_share_pages_and_prefix_cache(adapter_dir, tmp_path, reference):
    src, _ = adapter_dir
    llm = LLM(dtype="float32")
    shutil.copytree(src / "r8-all", tmp_path / "one")
    shutil.copytree(src / "r8-all", tmp_path / "two")
    llm.register_adapter("one", str(tmp_path / "one"))
    llm.register_adapter("two", str(tmp_path / "two"))
    assert run(llm, "one") == (reference["r8-all"], 0)
    pages = llm.stats()["pages"]["adapter"]
    tokens, cached = run(llm, "two")
    assert tokens == reference["r8-all"] and cached > 0                 # one's KV blocks serve two
    assert llm.stats()["pages"]["adapter"] == pages                     # and its pages: loaded once
    a = llm.engine.adapters
    assert a.lookup("one") is a.lookup("two") and a.stats.loads == 1
