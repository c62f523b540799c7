"""LoRA on a mixture-of-experts model's experts (PEFT `target_parameters` on `mlp.experts.gate_up_proj` /
`down_proj`), against PEFT: tiny random Mixtral and Qwen3-MoE models built with transformers' classes,
adapters on the experts alone, on the experts and the attention, on one of the two expert weights, with
rsLoRA; all of them, and base rows, in one mixed batch (PEFT runs one adapter at a time: it cannot mix
adapters of experts); greedy float32 tokens equal to PEFT's on every backend, bfloat16 within its rounding."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from bench.tiny_model import make_tiny
from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.engine.lora.test_fidelity import peft_greedy, peft_logits
from tests.engine.test_backend_fidelity import PROMPTS
from tests.kernels.backends import DEVICE, available_backends
from tests.peft_adapters import make_adapters

GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
SPECS = {
    "experts-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "target_parameters": [GATE_UP, DOWN]},
    "experts-attn-r8": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "o_proj"],
                        "target_parameters": [DOWN, GATE_UP]},
    "down-r2": {"r": 2, "lora_alpha": 6, "target_modules": ["k_proj"], "target_parameters": [DOWN]},
}
JOBS = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*SPECS, None, "experts-r4", None])]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family(request, tmp_path_factory, model_dir):
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp(f"experts-{request.param}")
    make_tiny(d / "model", model_dir, request.param)
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32, attn_implementation="eager").eval()
    # one PeftModel per adapter: PEFT holds adapters of experts together only when they adapt the same weights
    oracles = {name: make_adapters(model, d / "adapters", {name: spec}, seed=5 + i, std=0.3)
               for i, (name, spec) in enumerate(SPECS.items())}
    return request.param, d, oracles


def engine(d, backend: str, dtype: str = "float32") -> LLM:
    llm = LLM(model=str(d / "model"), dtype=dtype, backend=backend, device=str(DEVICE), max_num_batched_tokens=32,
              kv_cache_memory_bytes=1 << 22, block_size=32 if backend == "cpu" else 16)
    for name in SPECS:
        llm.register_adapter(name, str(d / "adapters" / name))
    return llm


@pytest.mark.parametrize("backend", available_backends())
def test_expert_adapters_match_peft_in_one_mixed_batch(backend, family):
    name, d, oracles = family
    llm = engine(d, backend)
    outs = llm.generate([ids for _, ids in JOBS], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        adapter=[a for a, _ in JOBS])
    want = [peft_greedy(oracles[a or "experts-r4"], a, ids, 8) for a, ids in JOBS]
    assert [o.token_ids for o in outs] == want, name
    base = [peft_greedy(oracles["experts-r4"], None, ids, 8) for _, ids in JOBS[:3]]
    assert want[:3] != base, "the adapters change the tokens"


@pytest.mark.parametrize("backend", available_backends())
def test_bfloat16_answers_as_peft_does_up_to_its_rounding(backend, family):
    """Each row's greedy bf16 token within 0.1 of PEFT's (float32) best log-probability."""
    _, d, oracles = family
    llm = engine(d, backend, "bfloat16")
    outs = llm.generate([ids for _, ids in JOBS], SamplingParams(temperature=0, max_tokens=1),
                        adapter=[a for a, _ in JOBS])
    for (a, ids), out in zip(JOBS, outs):
        ref = peft_logits(oracles[a or "experts-r4"], a, ids).log_softmax(-1)
        assert ref.max().item() - ref[out.token_ids[0]].item() < 0.1, (a, out.token_ids)


def test_expert_adapters_are_described_and_refused_by_name(family, tmp_path):
    _, d, _ = family
    llm = engine(d, "torch")
    a = llm.engine.adapters.lookup("experts-r4")
    E = llm.engine.cfg.model.moe.num_experts
    assert {m for _, m in a.layout.modules} == {"q_proj", "experts.gate_up_proj", "experts.down_proj"}
    assert {s.rank for (_, m), s in a.layout.modules.items() if m.startswith("experts.")} == {4 * E}
    bad = tmp_path / "patterned"
    shutil.copytree(d / "adapters" / "experts-r4", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(dict(cfg, rank_pattern={"q_proj": 2})))
    with pytest.raises(ValueError, match="rank_pattern / alpha_pattern together with target_parameters"):
        llm.register_adapter("patterned", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps(dict(cfg, target_parameters=["mlp.router.weight"])))
    with pytest.raises(ValueError, match="target_parameters 'mlp.router.weight' is not supported"):
        llm.register_adapter("router", str(bad))


def test_expert_adapters_on_a_model_without_experts_are_refused(family, tmp_path, model_dir):
    _, d, _ = family
    make_tiny(tmp_path / "dense", model_dir, "llama")
    llm = LLM(model=str(tmp_path / "dense"), dtype="float32")
    with pytest.raises(ValueError, match="adapts experts .target_parameters. but the base model has none"):
        llm.register_adapter("experts", str(d / "adapters" / "experts-r4"))
