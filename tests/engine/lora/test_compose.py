"""Several adapters on one request, each with a weight (engine/lora/compose.py), against PEFT's
add_weighted_adapter(combination_type="cat") on the same adapters and weights: compositions (of different
ranks, targets and signs), plain adapters and base rows in one mixed batch; greedy float32 tokens equal
to PEFT's on every backend. The prefix cache is keyed by the whole composition; a composition goes away
with its members; bad compositions are refused by name."""
from __future__ import annotations

import pytest
import torch

from bench.tiny_model import make_tiny
from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.engine.lora.test_fidelity import peft_greedy
from tests.engine.test_backend_fidelity import PROMPTS
from tests.kernels.backends import DEVICE, available_backends
from tests.peft_adapters import make_adapters

SPECS = {
    "qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]},
    "mlp-r6": {"r": 6, "lora_alpha": 3, "target_modules": ["gate_proj", "down_proj"]},
    "rs-r16": {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["o_proj", "up_proj"]},
}
COMPOSITIONS = {
    "two": [("qv-r4", 0.5), ("all-r8", 1.0)],
    "three": [("all-r8", -0.7), ("mlp-r6", 2.0), ("rs-r16", 1.5)],
    "four": [("qv-r4", 1.0), ("rs-r16", 0.25), ("mlp-r6", -1.0), ("all-r8", 0.8)],
}
# NOTE: no composition starts with the rsLoRA adapter: PEFT's "cat" adapter copies its first member's
# use_rslora, and then scales the whole sum by sqrt(its rank) instead of 1 (its quirk, not the formula)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    """A tiny random Llama, its adapters, and the PEFT oracle holding each composition as a "cat" adapter."""
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("compose")
    make_tiny(d / "model", model_dir, "llama")
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32).eval()
    oracle = make_adapters(model, d / "adapters", SPECS, seed=11, std=0.3)
    for name, members in COMPOSITIONS.items():
        oracle.add_weighted_adapter([n for n, _ in members], [w for _, w in members], name, combination_type="cat")
    return d, oracle


def engine(d, backend: str = "torch", names=SPECS, **kw) -> LLM:
    """A float32 engine on the tiny model of d / "model" with these adapters of d / "adapters" registered."""
    llm = LLM(model=str(d / "model"), dtype="float32", backend=backend, device=str(DEVICE), max_num_batched_tokens=32,
              kv_cache_memory_bytes=1 << 22, block_size=32 if backend == "cpu" else 16, **kw)
    for name in names:
        llm.register_adapter(name, str(d / "adapters" / name))
    return llm


@pytest.mark.parametrize("backend", available_backends())
def test_compositions_match_peft_cat_in_one_mixed_batch(backend, tiny):
    d, oracle = tiny
    jobs = [(COMPOSITIONS["two"], "two"), ("all-r8", "all-r8"), (COMPOSITIONS["three"], "three"), (None, None),
            (COMPOSITIONS["four"], "four"), ("qv-r4", "qv-r4")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(jobs))]
    n = 4 if backend == "triton" else 8       # (the Triton interpreter takes seconds a token)
    outs = engine(d, backend).generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                       adapter=[a for a, _ in jobs])
    want = [peft_greedy(oracle, name, ids, n) for (_, name), ids in zip(jobs, prompts)]
    assert [o.token_ids for o in outs] == want
    alone = [peft_greedy(oracle, member, prompts[0], n) for member, _ in COMPOSITIONS["two"]]
    assert want[0] not in alone, "a composition answers as neither of its members"


def test_the_prefix_cache_is_keyed_by_the_whole_composition(tiny):
    d, oracle = tiny
    llm = engine(d)
    prompt = list(range(300, 341))                   # longer than a KV block
    first = llm.generate([prompt], GREEDY, adapter=[COMPOSITIONS["two"]])[0]
    again = llm.generate([prompt], GREEDY, adapter=[COMPOSITIONS["two"]])[0]
    assert again.token_ids == first.token_ids == peft_greedy(oracle, "two", prompt, 8)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    other = llm.generate([prompt], GREEDY, adapter=[[("qv-r4", 0.5), ("all-r8", 0.9)]])[0]   # other weights
    assert other.num_cached_tokens == 0
    single = llm.generate([prompt], GREEDY, adapter="all-r8")[0]
    assert single.num_cached_tokens == 0                                                      # nor a member's


def test_a_composition_goes_away_with_its_members(tiny):
    d, _ = tiny
    llm = engine(d)
    llm.generate([PROMPTS[0]], GREEDY, adapter=[COMPOSITIONS["two"]])
    m = llm.engine.adapters
    (c,) = m.composed.values()
    pages = llm.engine.pool.usage()["adapter"]
    llm.unregister_adapter("qv-r4")
    assert not m.composed and c.adapter_id not in m.by_id
    assert llm.engine.pool.usage()["adapter"] < pages
    with pytest.raises(LookupError, match="qv-r4"):
        llm.generate([PROMPTS[0]], GREEDY, adapter=[COMPOSITIONS["two"]])
    assert llm.generate([PROMPTS[0]], GREEDY, adapter=[[("all-r8", 1.0)]])[0].token_ids


@pytest.mark.parametrize("members, error", [
    ([("qv-r4", 1.0)] * 2, "each adapter at most once"),
    ([(n, 1.0) for n in SPECS] + [("x", 1.0)], "5 adapters on one request; at most 4"),
    ([("qv-r4", 10.5)], r"scale of 'qv-r4' must be a finite number in \[-10, 10\]"),
    ([("qv-r4", float("nan"))], "must be a finite number"),
    ([("nope", 1.0)], "adapter 'nope' is not registered"),
])
def test_bad_compositions_are_refused_by_name(tiny, members, error):
    d, _ = tiny
    llm = engine(d)
    with pytest.raises((ValueError, LookupError), match=error):
        llm.generate([PROMPTS[0]], GREEDY, adapter=[members])
    assert llm.generate([PROMPTS[0]], GREEDY, adapter="qv-r4")[0].token_ids      # and it goes on serving


def test_ranks_beyond_max_lora_rank_are_refused(tiny):
    d, _ = tiny
    llm = engine(d, max_lora_rank=16)
    with pytest.raises(ValueError, match="ranks add up to 24, above max_lora_rank=16"):        # on o_proj, up_proj
        llm.generate([PROMPTS[0]], GREEDY, adapter=[[("all-r8", 1.0), ("rs-r16", 1.0)]])
    assert llm.generate([PROMPTS[0]], GREEDY, adapter=[[("qv-r4", 1.0), ("rs-r16", 1.0)]])[0].token_ids   # 16


def test_compositions_are_bounded_least_recently_asked_first(tiny, monkeypatch):
    """Clients choose scales freely: beyond compose.MAX_KEPT compositions the least recently asked idle one
    is forgotten (pages, host copy, prefix cache); one asked again is made again, with the same tokens."""
    from engine.lora import compose
    monkeypatch.setattr(compose, "MAX_KEPT", 2)
    d, oracle = tiny
    llm = engine(d)
    m = llm.engine.adapters
    first = llm.generate([PROMPTS[0]], GREEDY, adapter=[COMPOSITIONS["two"]])[0].token_ids
    old = next(iter(m.composed.values()))
    for w in (0.1, 0.2):
        llm.generate([PROMPTS[0]], GREEDY, adapter=[[("qv-r4", w)]])
    assert len(m.composed) == 2 and old.adapter_id not in m.by_id
    assert llm.engine.pool.usage()["adapter"] == sum(len(c.pages) for c in m.by_id.values())
    again = llm.generate([PROMPTS[0]], GREEDY, adapter=[COMPOSITIONS["two"]])[0].token_ids
    assert again == first == peft_greedy(oracle, "two", PROMPTS[0], 8)
