"""The warm-up a server on a GPU runs before it says it is ready (so that every Triton kernel is compiled
then): a prefill and decode steps of the base model and of an adapter on every projection, in one batch,
leaving nothing in use behind."""
from __future__ import annotations

import pytest

from bench.tiny_model import make_tiny
from engine.core.warm_up import NAME, warm_up
from engine.llm import LLM
from tests.conftest import assert_pool_idle


def test_warm_up_runs_base_and_adapter_steps_and_leaves_nothing_behind():
    llm = LLM(dtype="bfloat16")
    core = llm.engine
    execute, seen = core.runner.execute, []

    def recording(out, adapters=None):
        seen.append([(bool(r.adapter_id), n) for r, n in zip(out.requests, out.num_new_tokens)])
        return execute(out, adapters)
    core.runner.execute = recording
    warm_up(core)
    del core.runner.execute
    rows = [row for step in seen for row in step]
    assert any(lora and n > 1 for lora, n in rows) and any(not lora and n > 1 for lora, n in rows)   # prefills
    assert any(lora and n == 1 for lora, n in rows) and any(not lora and n == 1 for lora, n in rows)  # decodes
    assert any(len(step) == 2 for step in seen)                      # both in one batch
    assert not core.has_unfinished() and NAME not in core.adapters.names()
    assert core.pool.usage()["adapter"] == 0
    assert_pool_idle(llm)


@pytest.mark.parametrize("family", ["phi3", "gemma2", "mixtral"])
def test_the_warm_up_adapter_fits_each_familys_modules(family, tmp_path, model_dir):
    """Phi-3's throwaway adapter names its fused modules, a mixture of experts' its attention only: each is
    accepted, run and removed as on Llama."""
    d = make_tiny(tmp_path / family, model_dir, family)
    llm = LLM(model=str(d), dtype="float32", kv_cache_memory_bytes=1 << 24)
    warm_up(llm.engine)
    assert not llm.engine.has_unfinished() and NAME not in llm.engine.adapters.names()
    assert_pool_idle(llm)
