"""Write seeded random adapters in PEFT's on-disk format (adapter_config.json + safetensors) for benchmarks.

Writing the files directly is much faster than building a PeftModel per adapter; the format is the same
one PEFT saves (the tests check the engine against PEFT itself)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.lora.host_adapter import module_shape
from engine.lora.peft_config import module_path

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(d: Path, cfg: ModelConfig, r: int, targets=ALL, seed: int = 0, std: float = 0.02,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """dtype: what the file holds (PEFT saves float32 unless the model was cast)."""
    if (d / "adapter_config.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            n_in, n_out = module_shape(cfg, m)
            key = f"base_model.model.{module_path(layer, m)}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, n_in, generator=g) * std).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, r, generator=g) * std).to(dtype)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "bias": "none",
        "base_model_name_or_path": cfg.name, "task_type": "CAUSAL_LM"}))
    return d


def mean_pages(dirs, engine_cfg) -> float:
    """Pages of the unified pool the adapters in `dirs` take on average (as the engine lays them out)."""
    from engine.lora.host_adapter import load_host_adapter
    from engine.lora.layout import plan_layout
    from engine.model_runner import page_elems
    elems = page_elems(engine_cfg)
    pages = [plan_layout(load_host_adapter(d, engine_cfg.model, 64)).num_pages(elems) for d in dirs]
    return sum(pages) / len(pages)
