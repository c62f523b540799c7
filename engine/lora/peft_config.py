"""Read and validate a PEFT LoRA `adapter_config.json`.

Everything loraplex cannot apply exactly is refused with a ValueError naming the field; nothing is
silently ignored.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# The projections an adapter may target: the kernels' seven (what every adapter becomes), and the fused
# modules of families whose checkpoints fuse them (Phi-3), each made of kernel projections in row order.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp",
           "experts.gate_up_proj": "mlp", "experts.down_proj": "mlp"}
# what `target_parameters` may name: a mixture-of-experts layer's stacked expert weights (transformers' names)
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
ALL_LINEAR = ("all-linear",)


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def model_modules(fused: bool, moe: bool = False) -> tuple[str, ...]:
    """The modules a base model's adapters name: the fused ones for a fused checkpoint (Phi-3); the
    attention's alone for a mixture-of-experts model (its experts are not plain projections)."""
    if moe:
        return ATTENTION_MODULES
    return FUSED_MODULES if fused else MODULES


def module_path(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{_PREFIX[module]}.{module}"


@dataclass(frozen=True)
class LoraSpec:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model: str | None
    target_modules: tuple[str, ...] | None
    layers: tuple[int, ...] | None
    target_parameters: tuple[str, ...] = ()     # EXPERT_PARAMETERS it adapts (a mixture-of-experts model's)
    use_dora: bool = False                      # DoRA (engine/lora/dora.py): a magnitude per output row

    def expected_modules(self, num_layers: int, modules: tuple[str, ...] = MODULES) -> list[tuple[int, str]]:
        """(layer, module) pairs the config promises weights for (empty when it names them by regex);
        modules: the base model's (model_modules), what "all-linear" means."""
        if self.target_modules is None:
            return []
        layers = self.layers if self.layers is not None else range(num_layers)
        targets = modules if self.target_modules == ALL_LINEAR else self.target_modules
        return [(i, m) for i in layers for m in targets]

    def rank_for(self, path: str) -> int:
        return _match(self.rank_pattern, path, self.r)

    def scale_for(self, path: str) -> float:
        r = self.rank_for(path)
        alpha = _match(self.alpha_pattern, path, self.lora_alpha)
        return alpha / (r ** 0.5) if self.use_rslora else alpha / r


def _match(patterns: dict, path: str, default):
    # PEFT's rule: a pattern matches a module name that ends with it (as a regex), dot-separated.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def read_spec(adapter_dir: str | Path) -> LoraSpec:
    d = Path(adapter_dir)
    f = d / "adapter_config.json"
    if not f.is_file():
        raise ValueError(f"adapter: {d} has no adapter_config.json (not a PEFT adapter directory)")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"adapter: {f} is not valid JSON: {e}") from None
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter: peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("modules_to_save"):
        raise ValueError(f"adapter: modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter: bias {cfg['bias']!r} is not supported (only 'none')")
    for key in ("layer_replication", "trainable_token_indices"):
        if cfg.get(key):
            raise ValueError(f"adapter: {key} is not supported")
    params = _target_parameters(cfg)
    use_dora = cfg.get("use_dora", False)
    if not isinstance(use_dora, bool):
        raise ValueError(f"adapter: use_dora must be true or false, got {use_dora!r}")
    if use_dora and params:
        raise ValueError("adapter: use_dora (DoRA) together with target_parameters (experts) is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        known = (*MODULES, *FUSED)
        bad = [t for t in targets if t.split(".")[-1] not in known]
        if bad:
            raise ValueError(f"adapter: target_modules {bad} are not supported (only {', '.join(known)})")
        targets = tuple(sorted({t.split(".")[-1] for t in targets}))
    elif targets == "all-linear":
        targets = ALL_LINEAR
    else:
        targets = None      # a regex: the weights present say which modules it matched
    layers = cfg.get("layers_to_transform")
    layers = (layers,) if isinstance(layers, int) else tuple(layers) if layers else None
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"adapter: r must be a positive integer, got {r!r}")
    return LoraSpec(r=r, lora_alpha=float(cfg.get("lora_alpha", r)), use_rslora=bool(cfg.get("use_rslora")),
                    rank_pattern=dict(cfg.get("rank_pattern") or {}),
                    alpha_pattern={k: float(v) for k, v in (cfg.get("alpha_pattern") or {}).items()},
                    base_model=cfg.get("base_model_name_or_path"), target_modules=targets, layers=layers,
                    target_parameters=params, use_dora=use_dora)


def _target_parameters(cfg: dict) -> tuple[str, ...]:
    """PEFT's target_parameters: only the experts' stacked weights of a mixture-of-experts layer, each with
    the adapter's own r and lora_alpha (no rank or alpha pattern reaches them)."""
    names = cfg.get("target_parameters") or []
    if not isinstance(names, list):
        raise ValueError(f"adapter: target_parameters must be a list, got {names!r}")
    out = []
    for name in names:
        found = next((p for p in EXPERT_PARAMETERS if name == p or str(name).endswith("." + p)), None)
        if found is None:
            raise ValueError(f"adapter: target_parameters {name!r} is not supported (only a mixture-of-experts "
                             f"layer's {', '.join(EXPERT_PARAMETERS)})")
        out.append(found)
    if out and (cfg.get("rank_pattern") or cfg.get("alpha_pattern")):
        raise ValueError("adapter: rank_pattern / alpha_pattern together with target_parameters are not supported")
    return tuple(sorted(set(out)))
