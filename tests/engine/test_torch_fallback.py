"""Without a C compiler the engine runs on the reference torch backend: same greedy tokens as the CPU
backend (float32), for prefill chunks, decode and a prefix-cache hit."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from kernels.cpu.backend import CpuBackend

PROMPTS = [[1, 4093, 314, 253, 1345, 282, 2716, 30], list(range(300, 380)), [5, 6, 7], list(range(900, 1010))]


def run(llm):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, p)]
    again = [o.token_ids for o in llm.generate(PROMPTS[1:2], p)]          # prefix-cache hit
    return first, again


@pytest.mark.skipif(not CpuBackend.available(), reason="no C compiler here: only one path")
def test_torch_backend_gives_the_same_tokens():
    kw = dict(dtype="float32", max_num_batched_tokens=64, long_prefill_token_threshold=48)
    llm_c = LLM(backend="cpu", **kw)
    assert llm_c.engine.runner.backend.name == "cpu" and llm_c.engine.runner.backend.every_token_a_row
    with_c = run(llm_c)
    llm = LLM(backend="torch", **kw)
    assert llm.engine.runner.backend.name == "torch" and not llm.engine.runner.backend.every_token_a_row
    assert run(llm) == with_c


def test_auto_picks_the_cpu_backend_where_its_kernels_build():
    llm = LLM(dtype="float32", kv_cache_memory_bytes=1 << 24)
    assert llm.engine.runner.backend.name == ("cpu" if CpuBackend.available() else "torch")
