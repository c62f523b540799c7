"""Model families as descriptions of one shared decoder layer.

Every served family is the Llama layer (pre-norm RMSNorm, attention with RoPE and GQA, a gated MLP) with a
few switches; `Family` names them, and `describe(config.json's dict)` reads them for one model. The decoder
(engine/model/llama.py), the weight loader (weights.py) and every backend take the same description, so a
new family that shares the layer is a new entry in FAMILIES (its switches and how its config says them),
not a new model file. vLLM and SGLang keep one file per family (llama.py, qwen2.py, mistral.py, ... each
with its own attention and MLP classes); nano-vllm serves one family. With three backends (reference, C,
Triton) that each would need every file's variant, one layer with switches keeps the kernels' work to the
switches (docs/architecture.md argues the choice).

Switches (all off: Llama):
- qkv_bias: q, k and v projections have biases (Qwen2; Qwen3 when `attention_bias`), added before the
  adapters' deltas as in the checkpoint's Linear.
- qk_norm: RMSNorm of each head's q and k over head_dim before RoPE, one weight [head_dim] for q and one for
  k (Qwen3).
- fused_projections: the checkpoint stores q, k, v as one `qkv_proj` and gate, up as one `gate_up_proj`
  (Phi-3), and its PEFT adapters target those fused modules (engine/lora/host_adapter.py splits each into
  the per-projection pieces the kernels take: the same A, B's rows of that projection).
- layer windows: per layer, how many keys a token attends to (its own included): key j is visible to the
  query at position i iff i - window < j <= i; 0 is global attention (Mistral: every layer; Qwen2/Qwen3
  with `use_sliding_window`: the layers `layer_types` marks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Switches:
    """One model's switches (see the module doc): what the decoder and the backends read."""
    family: str
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_projections: bool = False
    layer_windows: tuple[int, ...] = ()      # [num_layers]; 0: global attention


def _windows(cfg: dict, sliding: bool) -> tuple[int, ...]:
    """Each layer's window: `layer_types` where the config has it, else every layer when `sliding`."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"model: layer_types has {len(types)} entries for {n} layers")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return tuple(window if sliding else 0 for _ in range(n))


def _llama(cfg: dict) -> Switches:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("model: Llama with attention_bias or mlp_bias is not served")
    return Switches("llama", layer_windows=_windows(cfg, False))


def _mistral(cfg: dict) -> Switches:
    return Switches("mistral", layer_windows=_windows(cfg, cfg.get("sliding_window") is not None))


def _qwen_windows(cfg: dict) -> tuple[int, ...]:
    """Qwen's windows exist only with `use_sliding_window` (its layer_types may say sliding without it);
    without layer_types, the layers from `max_window_layers` on slide."""
    n = cfg["num_hidden_layers"]
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return (0,) * n
    if cfg.get("layer_types"):
        return _windows(cfg, True)
    first = cfg.get("max_window_layers", n)
    return tuple(cfg["sliding_window"] if i >= first else 0 for i in range(n))


def _qwen2(cfg: dict) -> Switches:
    return Switches("qwen2", qkv_bias=True, layer_windows=_qwen_windows(cfg))


def _qwen3(cfg: dict) -> Switches:
    return Switches("qwen3", qkv_bias=bool(cfg.get("attention_bias")), qk_norm=True, layer_windows=_qwen_windows(cfg))


def _phi3(cfg: dict) -> Switches:
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"model: partial_rotary_factor {partial} (RoPE on part of each head) is not served")
    return Switches("phi3", fused_projections=True,
                    layer_windows=_windows(cfg, cfg.get("sliding_window") is not None))


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]          # config.json's model_type
    architectures: tuple[str, ...]        # config.json's architectures
    describe: Callable[[dict], Switches]


FAMILIES = (
    Family("Llama", ("llama",), ("LlamaForCausalLM",), _llama),
    Family("Mistral", ("mistral",), ("MistralForCausalLM",), _mistral),
    Family("Qwen2 / Qwen2.5", ("qwen2",), ("Qwen2ForCausalLM",), _qwen2),
    Family("Qwen3", ("qwen3",), ("Qwen3ForCausalLM",), _qwen3),
    Family("Phi-3", ("phi3",), ("Phi3ForCausalLM",), _phi3),
)


def served() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES)


def describe(cfg: dict, where: str = "config.json") -> Switches:
    """The switches of the model whose config.json is `cfg`; ValueError naming its architecture and the
    served ones when no family serves it."""
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    for f in FAMILIES:
        if model_type in f.model_types or any(a in f.architectures for a in archs):
            return f.describe(cfg)
    raise ValueError(f"model: {where} describes {', '.join(archs) or model_type!r} (model_type={model_type!r}), "
                     f"which loraplex does not serve; served: {served()}")
