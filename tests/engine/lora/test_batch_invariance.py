"""Randomised: a request's greedy output does not depend on what shares its batch, across adapters,
chunked prefill, preemption and prefix-cache hits: in float32, and in bfloat16 where the C kernels compute
every token's row on its own (GEMM, attention, LoRA)."""
import random

import pytest

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.peft_adapters import FIDELITY_ADAPTERS

PAGE_FP32 = 30 * 2 * 16 * 3 * 64 * 4


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def llm(adapter_dir, request):
    d, _ = adapter_dir
    page = PAGE_FP32 if request.param == "float32" else PAGE_FP32 // 2
    llm = LLM(dtype=request.param, max_loras=3, max_num_batched_tokens=96, long_prefill_token_threshold=32,
              kv_cache_memory_bytes=44 * page)
    for name in FIDELITY_ADAPTERS:
        llm.register_adapter(name, str(d / name))
    with llm:
        yield llm


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_equals_alone(llm, seed):
    rng = random.Random(seed)
    names = list(FIDELITY_ADAPTERS) + [None, None]
    shared = [rng.randrange(100, 30000) for _ in range(40)]
    prompts, adapters, params = [], [], []
    for _ in range(12):
        n = rng.randint(3, 90)
        ids = (shared[:n] if rng.random() < 0.4 else [rng.randrange(100, 30000) for _ in range(n)])
        prompts.append(ids)
        adapters.append(rng.choice(names))
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(4, 14), ignore_eos=True))
    pressure = lambda: llm.engine.scheduler.num_preemptions + llm.engine.adapters.stats.evictions  # noqa: E731
    before = pressure()
    together = llm.generate(prompts, params, adapter=adapters)
    assert pressure() > before, "the pool is sized to force preemptions or adapter evictions"
    for ids, a, p, out in zip(prompts, adapters, params, together):
        alone = llm.generate([ids], p, adapter=a)[0]
        assert out.token_ids == alone.token_ids, (a, len(ids))


def test_request_that_cannot_fit_next_to_its_adapter_is_refused(llm):
    with pytest.raises(ValueError, match="adapter 'r32-mlp'"):
        llm.generate([[5] * 200], SamplingParams(max_tokens=100), adapter="r32-mlp")
