"""Mixed adapters and base requests in one continuous batch, against PEFT's own output (float32)."""
import pytest
import torch

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.peft_adapters import FIDELITY_ADAPTERS

PROMPTS = ["The weather today is", "My favourite recipe uses", "In 1850 the city of", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(adapter_dir):
    d, _ = adapter_dir
    # max_loras 4 < 8 adapters: the cap is exercised while base requests run alongside.
    llm = LLM(dtype="float32", max_loras=4, max_lora_rank=64, max_num_batched_tokens=256)
    for name in FIDELITY_ADAPTERS:
        llm.register_adapter(name, str(d / name))
    with llm:
        yield llm


def peft_greedy(oracle, name, ids, n):
    with torch.no_grad():
        if name is None:
            with oracle.disable_adapter():
                out = oracle.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        else:
            oracle.set_adapter(name)
            out = oracle.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def peft_logits(oracle, name, ids):
    with torch.no_grad():
        if name is None:
            with oracle.disable_adapter():
                return oracle(input_ids=torch.tensor([ids])).logits[0, -1]
        oracle.set_adapter(name)
        return oracle(input_ids=torch.tensor([ids])).logits[0, -1]


def workload(tokenizer):
    names = list(FIDELITY_ADAPTERS) + [None, None]
    jobs = [(name, PROMPTS[(i + j) % len(PROMPTS)]) for i, name in enumerate(names) for j in range(2)]
    return [(name, tokenizer(p)["input_ids"]) for name, p in jobs]


def test_greedy_tokens_match_peft(llm, adapter_dir, tokenizer):
    _, oracle = adapter_dir
    jobs = workload(tokenizer)
    outs = llm.generate([ids for _, ids in jobs], SamplingParams(temperature=0, max_tokens=12),
                        adapter=[name for name, _ in jobs])
    for (name, ids), out in zip(jobs, outs):
        assert out.token_ids == peft_greedy(oracle, name, ids, 12), name
    # the adapters really change the output
    base_out = {tuple(ids): o.token_ids for (name, ids), o in zip(jobs, outs) if name is None}
    changed = sum(o.token_ids != base_out.get(tuple(ids), o.token_ids) for (n, ids), o in zip(jobs, outs) if n)
    assert changed >= 4
    assert_pool_idle_but_adapters(llm)


def test_last_position_logprobs_within_1e3(llm, adapter_dir, tokenizer):
    """The 20 most likely next tokens of every row, with their log-probabilities, as PEFT gives them."""
    _, oracle = adapter_dir
    jobs = workload(tokenizer)
    outs = llm.generate([ids for _, ids in jobs], SamplingParams(temperature=0, max_tokens=1, logprobs=20),
                        adapter=[name for name, _ in jobs])
    for (name, ids), out in zip(jobs, outs):
        ours = out.outputs[0].logprobs[0]                        # {token id: logprob}, 20 (+ the chosen one)
        ref = peft_logits(oracle, name, ids).log_softmax(-1)
        assert set(ref.topk(20).indices.tolist()) <= set(ours), name
        assert max(abs(lp - ref[t].item()) for t, lp in ours.items()) < 1e-3, name


def assert_pool_idle_but_adapters(llm):
    """No request holds pages; only resident (idle) adapters do."""
    usage = llm.engine.pool.usage()
    assert usage["kv"] == 0, usage
    assert all(a.active == 0 and a.queued == 0 for a in llm.engine.adapters.by_id.values())


def test_one_request_per_adapter_decodes_in_c_and_matches_peft(llm, adapter_dir, tokenizer):
    """One decode token per slot: the C decode kernel. The prompts' lengths put one adapter's prefill
    in another bucket whose slot lies inside the first bucket's slot range (a bug once applied that
    adapter twice)."""
    from kernels.cpu import lora as c_lora
    if not c_lora.supports(torch.float32):
        pytest.skip("no C compiler here")
    _, oracle = adapter_dir
    names = list(FIDELITY_ADAPTERS)[:4]
    jobs = [(name, tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]) for i, name in enumerate(names)]
    jobs.append((None, tokenizer(PROMPTS[0])["input_ids"]))
    used = []
    real = c_lora.LoraDecode.__call__

    def spy(self, *args):
        used.append(1)
        return real(self, *args)
    c_lora.LoraDecode.__call__ = spy
    try:
        outs = llm.generate([ids for _, ids in jobs], SamplingParams(temperature=0, max_tokens=10),
                            adapter=[name for name, _ in jobs])
    finally:
        c_lora.LoraDecode.__call__ = real
    assert used, "the C decode path was not exercised"
    for (name, ids), out in zip(jobs, outs):
        assert out.token_ids == peft_greedy(oracle, name, ids, 10), name
