"""The whole engine on every backend that runs here: a tiny random Llama (2 layers) with five PEFT adapters
of mixed ranks, targets, rsLoRA, rank_pattern and DoRA, in one batch with base requests; greedy float32 tokens
equal to transformers + PEFT's."""
from __future__ import annotations

import pytest
import torch

from bench.tiny_model import make_tiny_llama
from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.engine.lora.test_fidelity import peft_greedy
from tests.kernels.backends import DEVICE, available_backends
from tests.peft_adapters import make_adapters

TINY_ADAPTERS = {
    "t-r3-qv": dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]),
    "t-r8-all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]),
    "t-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "down_proj", "k_proj"]),
    "t-r5-pattern": dict(r=5, lora_alpha=10, target_modules=["q_proj", "up_proj", "gate_proj"],
                         rank_pattern={"up_proj": 12}, alpha_pattern={"gate_proj": 3}),
    "t-r6-dora": dict(r=6, lora_alpha=12, use_dora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
}
PROMPTS = [[1, 4093, 314, 253, 1345, 282, 2716, 30], list(range(300, 341)), [5, 6, 7], list(range(900, 917))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    """A random 2-layer Llama (the default model's tokenizer) and its adapters; the PeftModel oracle."""
    from transformers import LlamaForCausalLM
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(d / "model", model_dir)
    model = LlamaForCausalLM.from_pretrained(d / "model", dtype=torch.float32).eval()
    oracle = make_adapters(model, d / "adapters", TINY_ADAPTERS, seed=3, std=0.4)
    return d, oracle


@pytest.mark.parametrize("backend", available_backends())
def test_greedy_tokens_match_peft_on_every_backend(backend, tiny):
    d, oracle = tiny
    # NOTE: the CPU backend keeps each (layer, group) of an adapter inside one page: 16-token pages of this tiny
    # model (2,048 elements) are smaller than its rank-16 qkv block (3,072)
    llm = LLM(model=str(d / "model"), dtype="float32", backend=backend, device=str(DEVICE), max_num_batched_tokens=32,
              long_prefill_token_threshold=24, kv_cache_memory_bytes=1 << 22, block_size=32 if backend == "cpu" else 16)
    assert llm.engine.runner.backend.name == backend
    for name in TINY_ADAPTERS:
        llm.register_adapter(name, str(d / "adapters" / name))
    jobs = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*TINY_ADAPTERS, None, None])]
    outs = llm.generate([ids for _, ids in jobs], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        adapter=[name for name, _ in jobs])
    got = [o.token_ids for o in outs]
    want = [peft_greedy(oracle, name, ids, 8) for name, ids in jobs]
    assert got == want
    assert sum(g != peft_greedy(oracle, None, ids, 8) for g, (name, ids) in zip(got, jobs) if name) >= 3


@pytest.mark.parametrize("backend", available_backends())
def test_bfloat16_answers_as_peft_does_up_to_its_rounding(backend, tiny):
    """bfloat16 end to end (on CUDA under `make gpu-check`): the same mixed batch's first tokens. bf16 may break
    a near-tie otherwise than float32, so each row's greedy token must be within 0.1 of PEFT's (float32) best
    log-probability, and the log-probability the engine reports for it within 0.1 of PEFT's."""
    from tests.engine.lora.test_fidelity import peft_logits
    d, oracle = tiny
    llm = LLM(model=str(d / "model"), dtype="bfloat16", backend=backend, device=str(DEVICE),
              kv_cache_memory_bytes=1 << 22, block_size=32 if backend == "cpu" else 16)
    for name in TINY_ADAPTERS:
        llm.register_adapter(name, str(d / "adapters" / name))
    jobs = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*TINY_ADAPTERS, None, None])]
    outs = llm.generate([ids for _, ids in jobs], SamplingParams(temperature=0, max_tokens=1, logprobs=1),
                        adapter=[name for name, _ in jobs])
    for (name, ids), out in zip(jobs, outs):
        ref = peft_logits(oracle, name, ids).log_softmax(-1)
        token = out.token_ids[0]
        assert ref.max().item() - ref[token].item() < 0.1, (name, token)
        assert abs(out.outputs[0].logprobs[0][token] - ref[token].item()) < 0.1, name
