"""The one-call C decoder (kernels/cpu/csrc/decoder.c) gives exactly the bits of the op-by-op layer loop, over
chunked prefill, mixed prefill and decode steps, prompt logprobs, and adapters (decode and prefill)."""
import pytest

from bench.tiny_model import make_tiny
from engine.llm import LLM
from engine.model.llama import LlamaModel
from ipc.sampling_params import SamplingParams
from kernels.cpu.decoder import Decoder
from tests.peft_adapters import FIDELITY_ADAPTERS


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="bfloat16", max_num_batched_tokens=64, long_prefill_token_threshold=32,
              enable_prefix_caching=False)
    with llm:
        if llm.engine.runner.model.decoder(llm.engine.runner.kv_caches) is None:
            pytest.skip("the C decoder needs AVX512-BF16 and the paired KV layout")
        yield llm


@pytest.fixture
def calls(monkeypatch):
    """How many steps ran in the C decoder ("runs") and op by op ("loops")."""
    count = {"runs": 0, "loops": 0}
    run, loop = Decoder.run, LlamaModel._layers

    def counted_run(self, *args):
        count["runs"] += 1
        return run(self, *args)

    def counted_loop(self, *args):
        count["loops"] += 1
        return loop(self, *args)
    monkeypatch.setattr(Decoder, "run", counted_run)
    monkeypatch.setattr(LlamaModel, "_layers", counted_loop)
    return count


def _generate(llm, on: bool, adapter=None):
    llm.engine.runner.model.use_fused_decoder = on
    prompts = [list(range(200 + 7 * i, 200 + 7 * i + n)) for i, n in enumerate((3, 17, 40, 90, 5, 33, 61, 12, 26))]
    prompts.append("The capital of France is")
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=3, prompt_logprobs=2)
              for i in range(len(prompts))]
    try:
        outs = llm.generate(prompts, params, adapter=adapter)
    finally:
        llm.engine.runner.model.use_fused_decoder = True
    return [(o.token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def test_same_bits_as_the_op_by_op_loop(llm, calls, amx_tiles):
    fused = _generate(llm, True)
    assert calls["runs"] > 0 and calls["loops"] == 0
    runs = calls["runs"]
    assert _generate(llm, False) == fused         # token ids and every logprob, bit for bit
    assert calls["runs"] == runs and calls["loops"] == runs   # the second run did not use it


def test_same_bits_with_adapters(llm, adapter_dir, calls):
    """Steps with adapters run in the C decoder too (decode tokens' LoRA inside the GEMMs, prefill
    tokens' by segment): the op-by-op bits, with several adapters and base-model rows in one batch."""
    d, _ = adapter_dir
    names = list(FIDELITY_ADAPTERS)     # ranks 4-64, different targets, rank and alpha patterns, some layers
    for name in names:
        if name not in llm.engine.adapters.names():
            llm.register_adapter(name, str(d / name))
    adapters = names[:5] + [None] + names[5:] + [names[0]]
    fused = _generate(llm, True, adapter=adapters)
    runs = calls["runs"]
    assert runs > 0 and calls["loops"] == 0
    assert _generate(llm, False, adapter=adapters) == fused
    assert calls["runs"] == runs and calls["loops"] > 0


def test_same_bits_with_dora_adapters(llm, adapter_dir, calls, tmp_path):
    """DoRA rows (engine/model/dora_scales.py) inside the C decoder: each group's rows of a DoRA adapter
    scaled after its LoRA deltas, the op-by-op bits, with LoRA and base-model rows in the batch."""
    from bench.bench_dora import as_dora
    d, _ = adapter_dir
    for name in ("r8-all", "r16-rslora", "r8-pattern"):
        if name not in llm.engine.adapters.names():
            llm.register_adapter(name, str(d / name))
        llm.register_adapter(f"dora-{name}", str(as_dora(d / name, tmp_path / name, llm, seed=len(name))))
    adapters = ["dora-r8-all", None, "r8-all", "dora-r16-rslora", "dora-r8-pattern", "dora-r8-all", "r16-rslora",
                None, "dora-r16-rslora", "r8-pattern"]
    fused = _generate(llm, True, adapter=adapters)
    runs = calls["runs"]
    assert runs > 0 and calls["loops"] == 0
    assert _generate(llm, False, adapter=adapters) == fused
    assert calls["runs"] == runs and calls["loops"] > 0
    plain = _generate(llm, True, adapter=[a.removeprefix("dora-") if a else a for a in adapters])
    assert [p[0] for p in plain] != [f[0] for f in fused], "the DoRA scales were applied"


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_same_bits_with_each_familys_switches(family, tmp_path_factory, model_dir, calls):
    """q/k/v biases (Qwen2), q/k norms (Qwen3) and sliding windows of 12 tokens (all three, on some layers)
    inside the C decoder: the op-by-op bits over prompts longer than the window."""
    d = make_tiny(tmp_path_factory.mktemp(family) / "model", model_dir, family)
    llm = LLM(model=str(d), dtype="bfloat16", max_num_batched_tokens=64, long_prefill_token_threshold=32,
              enable_prefix_caching=False, kv_cache_memory_bytes=1 << 24)
    if llm.engine.runner.model.decoder(llm.engine.runner.kv_caches) is None:
        pytest.skip("the C decoder needs AVX512-BF16 and the paired KV layout")
    fused = _generate(llm, True)
    runs = calls["runs"]
    assert runs > 0 and calls["loops"] == 0
    assert _generate(llm, False) == fused
    assert calls["loops"] == runs
