"""Make seeded PEFT LoRA adapters for tests and benchmarks, with PEFT itself."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig kwargs: ranks 4..64, different target subsets, rsLoRA, rank_pattern, alpha_pattern
FIDELITY_ADAPTERS = {
    "r4-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8-all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "r16-attn": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r32-mlp": dict(r=32, lora_alpha=64, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "r64-ko": dict(r=64, lora_alpha=32, target_modules=["k_proj", "o_proj"]),
    "r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "r8-pattern": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"],
                       rank_pattern={"v_proj": 24, "model.layers.3.self_attn.q_proj": 4},
                       alpha_pattern={"up_proj": 4}),
    "r12-layers": dict(r=12, lora_alpha=24, target_modules=["q_proj", "gate_proj"], layers_to_transform=[0, 5, 29]),
}


def init_nonzero(model, name: str, seed: int, std: float = 0.06) -> None:
    """PEFT starts B at zero; give A and B seeded values so the adapter changes outputs. A DoRA adapter's
    magnitudes (PEFT sets them to the base rows' norms) each move by up to about 30%, as training would."""
    g = torch.Generator().manual_seed(seed)
    for mod_name, module in sorted(model.named_modules()):
        if hasattr(module, "lora_A") and name in module.lora_A:
            for w in (module.lora_A[name].weight, module.lora_B[name].weight):
                with torch.no_grad():
                    w.copy_(torch.randn(w.shape, generator=g) * std)
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags is not None and name in mags:
                m = mags[name].weight
                with torch.no_grad():
                    m.mul_(1 + 0.1 * torch.randn(m.shape, generator=g).clamp(-3, 3))


def make_adapters(base, out_dir: Path, specs: dict[str, dict], seed: int = 0, std: float = 0.06) -> PeftModel:
    """Save every adapter of `specs` to out_dir/<name>; return one PeftModel holding them all (the oracle)."""
    model = None
    for i, (name, kw) in enumerate(specs.items()):
        cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kw)
        if model is None:
            model = get_peft_model(copy.deepcopy(base), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        init_nonzero(model, name, seed + i, std)
    for name in specs:
        model.set_adapter(name)
        model.save_pretrained(out_dir / "_all", selected_adapters=[name])
        src = out_dir / "_all" / name if name != "default" else out_dir / "_all"
        src.rename(out_dir / name)
    model.eval()
    return model
