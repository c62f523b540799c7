"""An adapter's weights in host memory, validated against the base model.

`HostAdapter.modules[(layer, module)] = LoraModule(A [r, in], B [out, r], scale)` in the model dtype.
Only safetensors are read; pickled `.bin` weights are refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.lora.peft_config import MODULES, LoraSpec, module_path, read_spec

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoraModule:
    a: torch.Tensor      # [r, in]
    b: torch.Tensor      # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class HostAdapter:
    modules: dict[tuple[int, str], LoraModule]

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    def ranks(self) -> dict[tuple[int, str], int]:
        return {k: m.rank for k, m in self.modules.items()}


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a Llama projection."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (H, cfg.q_size), "k_proj": (H, cfg.kv_size), "v_proj": (H, cfg.kv_size),
            "o_proj": (cfg.q_size, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}[module]


def weights_file(adapter_dir: str | Path) -> Path:
    d = Path(adapter_dir)
    f = d / "adapter_model.safetensors"
    if not f.is_file():
        if (d / "adapter_model.bin").is_file():
            raise ValueError(f"adapter: {d} has only pickled adapter_model.bin; loraplex loads safetensors only")
        raise ValueError(f"adapter: {d} has no adapter_model.safetensors")
    return f


def load_host_adapter(adapter_dir: str | Path, cfg: ModelConfig, max_rank: int,
                      spec: LoraSpec | None = None, data: bytes | None = None) -> HostAdapter:
    """Read (or parse `data`, the safetensors file's bytes) and validate an adapter."""
    d = Path(adapter_dir)
    spec = spec or read_spec(d)
    f = weights_file(d)
    try:
        tensors = load_safetensors(data) if data is not None else load_file(str(f))
    except Exception as e:  # noqa: BLE001 - a corrupt file must name itself, whatever the parser raised
        raise ValueError(f"adapter: {f} is not a valid safetensors file: {e}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise ValueError(f"adapter: weight {key!r} is not supported (only LoRA A/B of "
                             f"{', '.join(MODULES)}; no embedding or lm_head LoRA)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES or layer >= cfg.num_layers:
            raise ValueError(f"adapter: weight {key!r} does not fit the base model "
                             f"({cfg.num_layers} layers, modules {', '.join(MODULES)})")
        parts.setdefault((layer, module), {})[ab] = tensor
    if not parts:
        raise ValueError(f"adapter: {f} holds no LoRA weights")
    missing = sorted(set(spec.expected_modules(cfg.num_layers)) - set(parts))
    if missing:
        layer, module = missing[0]
        raise ValueError(f"adapter: target_modules names {module} but {module_path(layer, module)} has no "
                         f"weights ({len(missing)} such modules missing)")
    modules = {}
    for (layer, module), ab in sorted(parts.items()):
        modules[(layer, module)] = _check_module(cfg, spec, layer, module, ab, max_rank)
    return HostAdapter(modules)


def _check_module(cfg, spec, layer, module, ab, max_rank) -> LoraModule:
    path = module_path(layer, module)
    if set(ab) != {"A", "B"}:
        raise ValueError(f"adapter: {path} has lora_{''.join(ab)} but not both A and B")
    a, b = ab["A"], ab["B"]
    n_in, n_out = module_shape(cfg, module)
    r = spec.rank_for(path)
    if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
        raise ValueError(f"adapter: {path} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                         f"model and rank {r} need ({r}, {n_in}) and ({n_out}, {r}) (different base architecture?)")
    if r > max_rank:
        raise ValueError(f"adapter: rank {r} of {path} is above max_lora_rank={max_rank}")
    weights = {"lora_A": a, "lora_B": b}
    for name, t in weights.items():
        if not t.is_floating_point():
            raise ValueError(f"adapter: {path}.{name} is {t.dtype}; LoRA weights must be floating point")
    weights = {name: t.to(cfg.dtype).contiguous() for name, t in weights.items()}
    for name, t in weights.items():
        # NaN, or beyond the model dtype's range: every output of this adapter's requests would be garbage
        if not torch.isfinite(t).all():
            raise ValueError(f"adapter: {path}.{name} holds NaN or infinite values (in {cfg.dtype})")
    return LoraModule(weights["lora_A"], weights["lora_B"], spec.scale_for(path))
