"""Every served family against transformers + PEFT: a tiny random model of the family built with
transformers' own classes (3 layers, its switches on: Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's
fused qkv_proj / gate_up_proj, Gemma's (1 + w) and sandwich norms, GeGLU, scaled embeddings, its query
scale, Gemma 2's score and logit soft-caps (small enough to bite), Gemma 3's q/k norms and local RoPE base,
a sliding window of 12 tokens on the windowed families' layers, smaller than
prompt + output), PEFT adapters on every projection (Phi-3's: on its fused modules), base and adapter rows
in one mixed batch; greedy float32 tokens equal to PEFT's on every backend, and bfloat16 (the CPU
backend's fused C decoder where it runs) within PEFT's rounding."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.tiny_model import FAMILIES, WINDOW, make_tiny
from engine.config import ModelConfig
from engine.llm import LLM
from engine.model.family import describe
from ipc.sampling_params import SamplingParams
from tests.engine.lora.test_fidelity import peft_greedy, peft_logits
from tests.engine.test_backend_fidelity import PROMPTS, TINY_ADAPTERS
from tests.kernels.backends import DEVICE, available_backends
from tests.peft_adapters import make_adapters

NEW = ("mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


def adapter_specs(family: str) -> dict[str, dict]:
    """TINY_ADAPTERS on the family's modules: Phi-3's adapters target its fused qkv_proj / gate_up_proj; a
    mixture-of-experts model's, its attention (the only projections PEFT targets there)."""
    if family in ("mixtral", "qwen3_moe"):
        return {name: {k: ([m for m in v if m in ATTENTION] if k == "target_modules" else
                           {m: x for m, x in v.items() if m in ATTENTION} if k.endswith("_pattern") else v)
                       for k, v in kw.items()} for name, kw in TINY_ADAPTERS.items()}
    if family != "phi3":
        return TINY_ADAPTERS
    out = {}
    for name, kw in TINY_ADAPTERS.items():
        kw = dict(kw, target_modules=sorted({FUSED.get(m, m) for m in kw["target_modules"]}))
        for key in ("rank_pattern", "alpha_pattern"):
            if key in kw:
                kw[key] = {FUSED.get(m, m): v for m, v in kw[key].items()}
        out[name] = kw
    return out


@pytest.fixture(scope="module", params=NEW)
def family(request, tmp_path_factory, model_dir):
    """(family, its tiny model's directory, the PeftModel oracle over its adapters)."""
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny(d / "model", model_dir, request.param)
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32, attn_implementation="eager").eval()
    oracle = make_adapters(model, d / "adapters", adapter_specs(request.param), seed=3, std=0.4)
    return request.param, d, oracle


def engine(d, backend: str, dtype: str) -> LLM:
    llm = LLM(model=str(d / "model"), dtype=dtype, backend=backend, device=str(DEVICE), max_num_batched_tokens=32,
              long_prefill_token_threshold=24, kv_cache_memory_bytes=1 << 22, block_size=32 if backend == "cpu" else 16)
    assert llm.engine.runner.backend.name == backend
    for name in TINY_ADAPTERS:
        llm.register_adapter(name, str(d / "adapters" / name))
    return llm


JOBS = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate([*TINY_ADAPTERS, None, None])]


def test_the_tiny_models_have_their_families_switches(family):
    name, d, _ = family
    cfg = ModelConfig.from_dir(d / "model", torch.float32)
    assert cfg.family == name
    gemma = name.startswith("gemma")
    assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name in ("qwen3", "gemma3", "qwen3_moe"))
    assert cfg.fused_projections == (name == "phi3")
    assert (cfg.norm_offset, cfg.sandwich_norms, cfg.embed_scale, cfg.activation == "gelu_tanh") == (gemma,) * 4
    assert (cfg.attn_softcap, cfg.final_softcap) == ((2.0, 5.0) if name == "gemma2" else (0.0, 0.0))
    assert cfg.attn_scale == (24 ** -0.5 if gemma else 0.0)
    assert cfg.local_rope_theta == (10000.0 if name == "gemma3" else 0.0)
    windows = {"mistral": (WINDOW,) * 3, "phi3": (WINDOW,) * 3, "gemma2": (WINDOW, 0, WINDOW),
               "gemma3": (WINDOW, 0, WINDOW), "mixtral": (WINDOW,) * 3, "qwen3_moe": (WINDOW,) * 3}
    assert cfg.layer_windows == windows.get(name, (0, WINDOW, WINDOW))
    moe = {"mixtral": (4, 2, True, False, 128, (True, True, True)),
           "qwen3_moe": (4, 2, True, True, 64, (True, False, True))}.get(name)
    assert (cfg.moe and dataclasses.astuple(cfg.moe)[:6]) == moe


@pytest.mark.parametrize("backend", available_backends())
def test_greedy_tokens_match_peft(backend, family):
    name, d, oracle = family
    llm = engine(d, backend, "float32")
    n = 4 if backend == "triton" else 8       # (the Triton interpreter takes seconds a token: prefill + 3 decodes)
    outs = llm.generate([ids for _, ids in JOBS], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        adapter=[a for a, _ in JOBS])
    got = [o.token_ids for o in outs]
    assert got == [peft_greedy(oracle, a, ids, n) for a, ids in JOBS], name
    assert sum(g != peft_greedy(oracle, None, ids, 8) for g, (a, ids) in zip(got, JOBS) if a) >= 3


@pytest.mark.parametrize("backend", available_backends())
def test_bfloat16_answers_as_peft_does_up_to_its_rounding(backend, family):
    """Each row's greedy bf16 token within 0.1 of PEFT's (float32) best log-probability, its reported
    log-probability within 0.1 of PEFT's; prompts longer than the window."""
    name, d, oracle = family
    llm = engine(d, backend, "bfloat16")
    jobs = [(a, ids) for a, ids in JOBS if len(ids) > WINDOW]
    outs = llm.generate([ids for _, ids in jobs], SamplingParams(temperature=0, max_tokens=1, logprobs=1),
                        adapter=[a for a, _ in jobs])
    for (a, ids), out in zip(jobs, outs):
        ref = peft_logits(oracle, a, ids).log_softmax(-1)
        token = out.token_ids[0]
        assert ref.max().item() - ref[token].item() < 0.1, (name, a, token)
        assert abs(out.outputs[0].logprobs[0][token] - ref[token].item()) < 0.1, (name, a)


def test_an_architecture_not_served_is_named_with_those_that_are():
    with pytest.raises(ValueError) as e:
        describe({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 2})
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "does not serve" in msg
    assert all(arch in msg for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                        "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                        "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"))


@pytest.mark.parametrize("cfg, windows", [
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None}, (0, 0)),
    ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 4096}, (4096, 4096)),
    ({"model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 64, "use_sliding_window": False,
      "layer_types": ["sliding_attention"] * 3}, (0, 0, 0)),
    ({"model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 64, "use_sliding_window": True,
      "max_window_layers": 2}, (0, 0, 64)),
    ({"model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 8, "use_sliding_window": True,
      "layer_types": ["sliding_attention", "full_attention"]}, (8, 0)),
    ({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 16}, (16, 0, 16, 0)),       # older configs
    ({"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 16, "sliding_window_pattern": 6},
     (16, 16, 16, 16, 16, 0, 16)),
])
def test_windows_follow_each_familys_config(cfg, windows):
    assert describe(cfg).layer_windows == windows


def test_phi3_with_partial_rotary_embedding_is_refused_by_name():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        describe({"model_type": "phi3", "num_hidden_layers": 2, "rope_parameters": {"partial_rotary_factor": 0.75}})


def test_families_of_the_tiny_builder_are_the_served_ones():
    assert set(FAMILIES) == {"llama", *NEW}


@pytest.mark.parametrize("family, module, other", [("phi3", "q_proj", "qkv_proj"), ("qwen2", "qkv_proj", "q_proj"),
                                                   ("mixtral", "gate_proj", "o_proj")])
def test_an_adapter_of_the_other_layout_is_refused_naming_the_modules(family, module, other, tmp_path, model_dir):
    """Phi-3's adapters name its fused modules; an adapter naming q_proj does not fit it (and the other way);
    a mixture-of-experts model's adapters name its attention projections only."""
    import json

    from safetensors.torch import save_file

    from engine.lora.host_adapter import describe_adapter
    d = make_tiny(tmp_path / "model", model_dir, family)
    cfg = ModelConfig.from_dir(d, torch.float32)
    a = tmp_path / "adapter"
    a.mkdir()
    key = f"base_model.model.model.layers.0.self_attn.{module}"
    save_file({f"{key}.lora_A.weight": torch.ones(2, 64), f"{key}.lora_B.weight": torch.ones(128, 2)},
              str(a / "adapter_model.safetensors"))
    (a / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
                                                       "target_modules": [module]}))
    with pytest.raises(ValueError, match=f"does not fit the base model.*{other}"):
        describe_adapter(a, cfg, 64)
