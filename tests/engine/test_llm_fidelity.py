"""Greedy output of the engine against transformers' generate on the same float32 weights."""
import pytest

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle, hf_greedy

PAGE_FP32 = 30 * 2 * 16 * 3 * 64 * 4   # bytes of one KV page of the default model in float32


@pytest.fixture(scope="module")
def small_llm():
    # 40 pages of 16 tokens: too few for all prompts at once, so some requests are preempted;
    # a 64-token prefill chunk, so the long prompt is computed in several chunks.
    with LLM(dtype="float32", long_prefill_token_threshold=64, max_num_batched_tokens=160,
             kv_cache_memory_bytes=40 * PAGE_FP32) as llm:
        yield llm


def test_greedy_matches_transformers_with_chunks_and_preemption(small_llm, hf_model, tokenizer):
    llm = small_llm
    prompts = [("word " * (i * 7)) + f"Tell me a story about the number {i}." for i in range(9)]
    prompts.append("The history of the city is long and interesting. " * 25)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert max(len(i) for i in ids) > 64
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24))
    assert llm.engine.scheduler.num_preemptions > before, "the test must exercise preemption"
    for prompt_ids, out in zip(ids, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt_ids, 24), len(prompt_ids)
        assert out.finish_reason in ("stop", "length")
    assert_pool_idle(llm)


def test_prefix_cache_hit_gives_the_same_tokens(small_llm):
    llm = small_llm
    prompt = "A long shared system prompt about tenants and adapters. " * 6 + "Question: what now?"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    miss = llm.generate(prompt, params)[0]
    hit = llm.generate(prompt, params)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens >= 48
    assert hit.token_ids == miss.token_ids
    assert llm.engine.pool.prefix_hits >= 1
    assert_pool_idle(llm)


def test_logprobs_match_transformers(small_llm, hf_model, tokenizer):
    """Each generated token's logprob and the top alternatives: log_softmax of transformers' logits."""
    import torch
    ids = tokenizer("The capital of France is")["input_ids"]
    out = small_llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.outputs[0].logprobs) == len(out.token_ids) == 4
    seq = ids + out.token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([seq])).logits[0].float().log_softmax(-1)      # [len, vocab]
    for i, (tok, got) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + i]
        top_v, top_i = row.topk(3)
        assert set(got) == {tok, *top_i.tolist()}
        for t, v in got.items():
            assert abs(v - float(row[t])) < 1e-3, (i, t)
    assert small_llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].logprobs is None


def test_prompt_logprobs_match_transformers_over_chunks_and_a_cached_prefix(small_llm, hf_model, tokenizer):
    """prompt_logprobs: each prompt token's logprob where it was predicted (None for the first) and the
    top alternatives, for a prompt prefilled in several chunks whose prefix is in the cache (a request
    asking for prompt logprobs computes its whole prompt), next to a request that does not ask."""
    import torch
    text = "The history of the city is long and interesting. " * 8
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 64                                        # more than one 64-token chunk
    small_llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))        # its prefix now cached
    outs = small_llm.generate([ids, ids[:10]], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                                               SamplingParams(temperature=0, max_tokens=2)])
    got = outs[0].prompt_logprobs
    assert outs[0].num_cached_tokens == 0 and outs[1].prompt_logprobs is None
    assert len(got) == len(ids) and got[0] is None
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)    # [len, vocab]
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert set(got[i]) == {ids[i], *row.topk(2).indices.tolist()}, i
        for t, v in got[i].items():
            assert abs(v - float(row[t])) < 1e-3, (i, t)
    assert_pool_idle(small_llm)
