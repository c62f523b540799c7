"""Without a C compiler the engine runs on its torch paths: same greedy tokens as with the C kernels
(float32), for prefill chunks, decode and a prefix-cache hit."""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.cpu import attention, elementwise

PROMPTS = [[1, 4093, 314, 253, 1345, 282, 2716, 30], list(range(300, 380)), [5, 6, 7], list(range(900, 1010))]


def run(llm):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, p)]
    again = [o.token_ids for o in llm.generate(PROMPTS[1:2], p)]          # prefix-cache hit
    return first, again


@pytest.mark.skipif(not attention.supports(torch.float32), reason="no C compiler here: only one path")
def test_torch_paths_give_the_same_tokens(monkeypatch):
    kw = dict(dtype="float32", max_num_batched_tokens=64, long_prefill_token_threshold=48)
    with_c = run(LLM(**kw))
    monkeypatch.setattr(attention, "supports", lambda dtype: False)
    monkeypatch.setattr(elementwise, "supports", lambda dtype: False)
    llm = LLM(**kw)
    assert not llm.engine.runner.c_decode_attention
    assert llm.engine.runner.model.ops.__name__ == "TorchOps"
    assert run(llm) == with_c
