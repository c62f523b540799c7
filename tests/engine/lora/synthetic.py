"""Small PEFT-format adapters for a tiny Llama config, for tests that need no real model."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig

TINY = ModelConfig(path="tiny", name="tiny", dtype=torch.float32, vocab_size=64, hidden_size=32,
                   intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_model_len=128,
                   tie_word_embeddings=True, eos_token_ids=(0,))

SHAPES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
          "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}


def write_adapter(d: Path, r: int, targets=("q_proj", "v_proj"), seed: int = 0, config_extra: dict | None = None,
                  layers: int = 2, extra_tensors: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for m in targets:
            n_in, n_out = SHAPES[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(d / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "bias": "none"}
    cfg.update(config_extra or {})
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d
