"""The LoRA API of the offline engine: registry at run time, cap, prefix cache, CLI."""
import json
import shutil

import pytest

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.conftest import cli_in_process
from tests.engine.lora.test_fidelity import peft_greedy
from tests.peft_adapters import FIDELITY_ADAPTERS

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(adapter_dir):
    d, _ = adapter_dir
    llm = LLM(dtype="float32", max_loras=2, max_num_batched_tokens=256)
    for name in FIDELITY_ADAPTERS:
        llm.register_adapter(name, str(d / name))
    with llm:
        yield llm


def test_unknown_adapter_is_refused_and_engine_keeps_serving(llm):
    with pytest.raises(LookupError, match="nope"):
        llm.generate("Hello", GREEDY, adapter="nope")
    assert llm.generate("Hello", GREEDY)[0].token_ids


def test_cap_with_many_adapters_and_base_requests_finishes(llm):
    names = list(FIDELITY_ADAPTERS) * 2 + [None] * 6
    outs = llm.generate(["Tell me about rivers."] * len(names), GREEDY, adapter=names)
    assert all(len(o.token_ids) == 8 for o in outs)
    report = llm.stats()
    assert report["adapters"]["cold_starts"] >= 1 and report["adapters"]["loads"] >= len(FIDELITY_ADAPTERS)
    assert 0 <= report["adapters"]["hit_rate"] <= 1
    assert report["pages"]["kv"] == 0 and report["pages"]["adapter"] > 0
    assert sum(report["pages"].values()) == report["num_pages"]


def test_reregister_with_new_weights_drops_prefix_blocks(llm, adapter_dir):
    d, _ = adapter_dir
    prompt = "A shared prefix that is long enough to fill a few blocks of the cache. " * 3
    first = llm.generate(prompt, GREEDY, adapter="r4-qv")[0]
    again = llm.generate(prompt, GREEDY, adapter="r4-qv")[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    old_id = llm.engine.adapter_id("r4-qv")
    cached_before = len(llm.engine.pool.hash_to_page)
    assert llm.engine.kv.adapter_hashes[old_id]
    llm.register_adapter("r4-qv", str(d / "r8-all"))          # same name, new weights
    assert old_id not in llm.engine.kv.adapter_hashes          # its prefix blocks are dropped
    assert len(llm.engine.pool.hash_to_page) < cached_before
    swapped = llm.generate(prompt, GREEDY, adapter="r4-qv")[0]
    assert swapped.num_cached_tokens == 0
    assert swapped.token_ids == llm.generate(prompt, GREEDY, adapter="r8-all")[0].token_ids
    llm.register_adapter("r4-qv", str(d / "r4-qv"))


def own_content(src, dst) -> str:
    """A copy of adapter `src` with a content of its own (another lora_alpha): a plain copy would be one
    more name of `src` (adapters are known by content), sharing its pages and its loads."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg.get("lora_alpha", 8) + 1
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_unregister_frees_pages_and_refuses_new_requests(llm, adapter_dir, tmp_path):
    d, _ = adapter_dir
    llm.register_adapter("temp", own_content(d / "r16-attn", tmp_path / "temp"))
    llm.generate("Hi", GREEDY, adapter="temp")
    pages_before = llm.engine.pool.usage()["adapter"]
    llm.unregister_adapter("temp")
    assert llm.engine.pool.usage()["adapter"] < pages_before
    assert "temp" not in llm.list_adapters()
    with pytest.raises(LookupError):
        llm.generate("Hi", GREEDY, adapter="temp")


def test_cli_generate_with_adapter_dir(adapter_dir, tokenizer, capsys):
    d, oracle = adapter_dir
    rc, out, err = cli_in_process(capsys, "generate", "--dtype", "float32", "--prompt", "The weather today is",
                                  "--max-tokens", "6", "--ignore-eos", "--adapter-dir", str(d), "--adapter", "r8-all",
                                  "--json")
    assert rc == 0, err
    ids = tokenizer("The weather today is")["input_ids"]
    assert json.loads(out)["token_ids"] == peft_greedy(oracle, "r8-all", ids, 6)


def test_a_loading_adapter_holds_up_nobody(llm, adapter_dir, monkeypatch, tmp_path):
    """While one adapter's file is slow to read, base and resident-adapter requests keep decoding."""
    import time as _time

    from engine.lora import loader
    from engine.lora.adapter_manager import AdapterState
    from ipc.requests import GenerateRequest
    d, _ = adapter_dir
    def slowed(real):
        def slow(*args, **kwargs):
            _time.sleep(1.5)
            return real(*args, **kwargs)
        return slow
    for reader in ("read_packed", "pack_in_place"):      # into a staging buffer, or into the pages
        monkeypatch.setattr(loader, reader, slowed(getattr(loader, reader)))
    llm.register_adapter("slow", own_content(d / "r32-mlp", tmp_path / "slow"))
    core = llm.engine
    core.adapters.host.clear()         # not in the host tier: the load must read the (slow) disk
    core.add_request(GenerateRequest("slow-req", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True), adapter="slow"))
    core.add_request(GenerateRequest("base-req", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=2000,
                                                                               ignore_eos=True)))
    tokens_while_loading, slow_done, base_done = 0, False, False
    deadline = _time.monotonic() + 300   # a hang guard, not a timing bound
    while not slow_done and _time.monotonic() < deadline:
        loading = core.adapters.lookup("slow").state == AdapterState.LOADING
        outs = core.step()
        if loading:
            tokens_while_loading += sum(len(o.new_token_ids) for o in outs if o.request_id == "base-req")
        slow_done |= any(o.request_id == "slow-req" and o.finish_reason for o in outs)
        base_done |= any(o.request_id == "base-req" and o.finish_reason for o in outs)
    assert slow_done, "the slowly loaded adapter's request did not finish within the hang guard"
    assert not base_done, "the base request ran out of tokens before the adapter's request finished"
    assert core.abort("base-req")
    core.settle()
    assert not core.has_unfinished()
    assert tokens_while_loading >= 5, "the base request must decode while the adapter loads"
    assert core.adapters.stats.cold_starts >= 1
    llm.unregister_adapter("slow")


def test_a_small_adapter_arriving_while_others_run_starts_in_the_next_step(llm, adapter_dir, tmp_path, monkeypatch):
    """A request for a small adapter not loaded yet, arriving while another request decodes, gets its first
    token from the very next step: its load finishes before that step is scheduled
    (AdapterManager.finish_small_loads). A load over SMALL_LOAD_BYTES stays paced beside the step: its
    request starts a step later at the earliest."""
    from engine.lora import adapter_manager
    from ipc.requests import GenerateRequest
    monkeypatch.setattr(adapter_manager, "SMALL_LOAD_WAIT_S", 60.0)   # a hang guard: no speed is tested
    d, _ = adapter_dir
    core = llm.engine
    core.add_request(GenerateRequest("runs", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=60,
                                                                         ignore_eos=True)))
    core.step()
    src = d / "r4-qv"
    assert adapter_manager.SMALL_LOAD_BYTES == 8 << 20
    for limit, earliest in ((8 << 20, 1), (0, 2)):
        name = f"arrives-{limit}"
        llm.register_adapter(name, own_content(src, tmp_path / name))     # each a content of its own
        src = tmp_path / name
        monkeypatch.setattr(adapter_manager, "SMALL_LOAD_BYTES", limit)
        core.add_request(GenerateRequest(name, [1, 2, 3], GREEDY, adapter=name))
        steps, first = 0, False
        while not first and steps < 100:
            outs = core.step()
            steps += 1
            first = any(o.request_id == name and o.new_token_ids for o in outs)
        assert first and (steps == 1 if earliest == 1 else steps >= 2), (limit, steps)
    core.abort("runs")
    while core.has_unfinished():
        core.step()
    for limit in (8 << 20, 0):
        llm.unregister_adapter(f"arrives-{limit}")        # the module's other tests make the same contents


def test_adapter_whose_files_broke_fails_its_requests_with_an_error(llm, adapter_dir, tmp_path):
    d, _ = adapter_dir
    llm.register_adapter("fragile", own_content(d / "r4-qv", tmp_path / "fragile"))
    llm.engine.adapters.host.clear()                       # force a read from disk at load time
    (tmp_path / "fragile" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    broken, fine = llm.generate(["Hi", "Hi"], GREEDY, adapter=["fragile", None])
    assert broken.finish_reason == "abort" and "fragile" in broken.error
    assert fine.finish_reason == "length" and fine.error is None
    llm.unregister_adapter("fragile")


def test_many_adapters_through_a_small_pool_load_each_about_once(tmp_path):
    """24 requests, each on its own adapter, 8 at a time, the pool holding the KV of 8 requests and about
    8 adapters: loads stay near one per adapter. (Loads started for requests far back in line, and
    prefetches into pages the running requests' KV needed next, used to evict adapters before their
    requests ran: with 256 adapters, 35 loads per adapter and a quarter of the throughput.)"""
    import torch

    from bench.adapters import mean_pages, write_peft_adapter
    from engine.config import EngineConfig
    from engine.model_runner import page_elems
    cfg = EngineConfig.create(dtype="bfloat16")
    dirs = [write_peft_adapter(tmp_path / f"t{i}", cfg.model, [4, 8][i % 2], ("q_proj", "v_proj"), seed=i)
            for i in range(24)]
    prompt_len, out_len, seqs = 24, 24, 8
    kv_pages = seqs * -(-(prompt_len + out_len) // cfg.cache.block_size)
    pages = kv_pages + round(seqs * mean_pages(dirs[:2], cfg))
    llm = LLM(dtype="bfloat16", max_num_seqs=seqs, max_loras=seqs, max_lora_rank=8, max_num_batched_tokens=256,
              enable_prefix_caching=False, kv_cache_memory_bytes=pages * page_elems(cfg) * 2)
    for i, d in enumerate(dirs):
        llm.register_adapter(f"t{i}", str(d))
    prompts = torch.randint(100, 40000, (24, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
                        adapter=[f"t{i}" for i in range(24)])
    assert all(len(o.token_ids) == out_len for o in outs)
    stats = llm.engine.adapters.stats
    assert stats.loads <= 30, stats
    llm.close()


def test_close_stops_the_loader_threads_and_refuses_later_work(adapter_dir):
    import threading

    d, _ = adapter_dir
    name = next(iter(FIDELITY_ADAPTERS))
    before = set(threading.enumerate())
    with LLM(dtype="float32", max_num_batched_tokens=256) as llm:
        llm.register_adapter(name, str(d / name))
        assert llm.generate("Hello", GREEDY, adapter=name)[0].token_ids
        mine = [t for t in set(threading.enumerate()) - before if t.name.startswith("loraplex-")]
        assert any(t.name.startswith("loraplex-loader") for t in mine), mine
    assert not [t for t in mine if t.is_alive()]
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hello", GREEDY)
    llm.close()                                   # idempotent
