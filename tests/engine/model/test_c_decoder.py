"""The one-call C decoder (kernels/cpu/decoder.c) gives exactly the bits of the op-by-op layer loop, over
chunked prefill, mixed prefill and decode steps, and prompt logprobs; and steps with an adapter keep the
op-by-op path (their LoRA deltas are added between the ops)."""
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.cpu.decoder import Decoder
from tests.peft_adapters import FIDELITY_ADAPTERS


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="bfloat16", max_num_batched_tokens=64, long_prefill_token_threshold=32,
              enable_prefix_caching=False)
    if llm.engine.runner.model.decoder(llm.engine.runner.kv_caches) is None:
        pytest.skip("the C decoder needs AVX512-BF16 and the paired KV layout")
    return llm


@pytest.fixture
def calls(monkeypatch):
    count = {"runs": 0}
    run = Decoder.run

    def counted(self, *args):
        count["runs"] += 1
        return run(self, *args)
    monkeypatch.setattr(Decoder, "run", counted)
    return count


def _generate(llm, on: bool, adapter=None):
    llm.engine.runner.model.use_c_decoder = on
    prompts = [list(range(200, 200 + n)) for n in (3, 17, 40, 90)] + ["The capital of France is"]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=3, prompt_logprobs=2)
              for i in range(len(prompts))]
    try:
        outs = llm.generate(prompts, params, adapter=adapter)
    finally:
        llm.engine.runner.model.use_c_decoder = True
    return [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def test_same_bits_as_the_op_by_op_loop(llm, calls):
    fused = _generate(llm, True)
    assert calls["runs"] > 0
    runs = calls["runs"]
    assert _generate(llm, False) == fused         # token ids and every logprob, bit for bit
    assert calls["runs"] == runs                  # the second run did not use it


def test_steps_with_an_adapter_take_the_op_by_op_path(llm, adapter_dir, calls):
    d, _ = adapter_dir
    name = next(iter(FIDELITY_ADAPTERS))
    llm.register_adapter(name, str(d / name))
    _generate(llm, True, adapter=[name] * 5)
    assert calls["runs"] == 0
