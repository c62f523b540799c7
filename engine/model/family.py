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
- Gemma's: norm_offset (RMSNorm weights applied as 1 + w), sandwich_norms (the attention's and the MLP's
  outputs RMS-normed before their residual adds, the MLP's input by its own pre-feedforward norm),
  activation "gelu_tanh" (GeGLU), embed_scale (embeddings times sqrt(hidden), rounded to the model dtype),
  attn_scale (query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5), attn_softcap (attention scores
  cap * tanh(score / cap), Gemma 2) and final_softcap (the logits likewise), and a RoPE of the sliding
  layers' own (Gemma 3's local base).
- moe: a mixture-of-experts MLP (`MoeSpec`: Mixtral, Qwen3-MoE): a router picks each token's top-k
  experts (gated MLPs), whose outputs are summed with the router's weights; adapters on the attention.
- layer windows: per layer, how many keys a token attends to (its own included): key j is visible to the
  query at position i iff i - window < j <= i; 0 is global attention (Mistral: every layer; Qwen2/Qwen3
  with `use_sliding_window`: the layers `layer_types` marks).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP: `num_experts` gated MLPs of `intermediate` each, the router's softmax
    top `top_k` per token (renormalised to sum 1 when `norm_topk_prob`; the weights rounded to the model
    dtype before use when `weights_in_dtype`, as Qwen3-MoE does, else kept in fp32 as Mixtral's), on the
    layers `sparse` marks (the others a dense MLP of intermediate_size). `names`: the checkpoint's
    ("mixtral": block_sparse_moe.gate / experts.E.w1, w3, w2; "qwen": mlp.gate / experts.E.gate_proj,
    up_proj, down_proj)."""
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    weights_in_dtype: bool
    intermediate: int
    sparse: tuple[bool, ...]
    names: str


@dataclass(frozen=True)
class Switches:
    """One model's switches (see the module doc): what the decoder and the backends read."""
    family: str
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_projections: bool = False
    layer_windows: tuple[int, ...] = ()      # [num_layers]; 0: global attention
    rope: tuple = (10000.0, None)            # (theta, llama3 / linear scaling or None) of every layer
    local_rope: tuple | None = None          # the sliding layers' own (theta, scaling); None: `rope`
    norm_offset: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"                 # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False
    attn_scale: float | None = None          # None: head_dim ** -0.5
    attn_softcap: float = 0.0                # 0: none
    final_softcap: float = 0.0
    moe: MoeSpec | None = None


def rope_of(params: dict, where: str = "config.json") -> tuple:
    """(theta, scaling) from a rope parameter dict (`rope_parameters`, or `rope_scaling` plus `rope_theta`):
    scaling None for the default RoPE, the dict for "llama3" and "linear"; other types refused by name."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"model: rope_type {rope_type!r} in {where} is not supported")
    return float(params.get("rope_theta", 10000.0)), (dict(params, rope_type=rope_type)
                                                      if rope_type != "default" else None)


def _rope(cfg: dict, where: str) -> tuple:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in params:                 # per layer type (Gemma 3): the global layers'
        params = dict(params["full_attention"])
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope_of(params, where)


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


def _gemma_types(cfg: dict, pattern: int) -> dict:
    """cfg with `layer_types`: as given, else every `pattern`-th layer global (Gemma 2: 2, Gemma 3's
    `sliding_window_pattern`: 6), the others sliding."""
    if cfg.get("layer_types"):
        return cfg
    n = cfg["num_hidden_layers"]
    return dict(cfg, layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                  for i in range(n)])


def _gemma(cfg: dict, name: str, pattern: int, **extra) -> Switches:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("model: use_bidirectional_attention (not a causal language model) is not served")
    if cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh")) not in ("gelu_pytorch_tanh",
                                                                                           "gelu_tanh"):
        raise ValueError(f"model: hidden_activation {cfg.get('hidden_activation')!r} is not served")
    scalar = cfg.get("query_pre_attn_scalar")
    return Switches(name, layer_windows=_windows(_gemma_types(cfg, pattern), True), norm_offset=True,
                    sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
                    attn_scale=float(scalar) ** -0.5 if scalar else None,
                    final_softcap=float(cfg.get("final_logit_softcapping") or 0.0), **extra)


def _gemma2(cfg: dict) -> Switches:
    return _gemma(cfg, "gemma2", 2, attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0))


def _gemma3(cfg: dict) -> Switches:
    params = cfg.get("rope_parameters") or {}
    if "sliding_attention" in params:
        local = rope_of(dict(params["sliding_attention"]))
    else:
        local = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
    return _gemma(cfg, "gemma3", int(cfg.get("sliding_window_pattern") or 6), qk_norm=True,
                  attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0), local_rope=local)


def _mixtral(cfg: dict) -> Switches:
    n = cfg["num_hidden_layers"]
    moe = MoeSpec(int(cfg.get("num_local_experts") or cfg.get("num_experts")), int(cfg["num_experts_per_tok"]),
                  True, False, int(cfg["intermediate_size"]), (True,) * n, "mixtral")
    return dataclasses.replace(_mistral(cfg), family="mixtral", moe=moe)


def _qwen3_moe(cfg: dict) -> Switches:
    n = cfg["num_hidden_layers"]
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    moe = MoeSpec(experts, int(cfg["num_experts_per_tok"]), bool(cfg.get("norm_topk_prob")), True,
                  int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]), sparse, "qwen")
    # transformers' Qwen3-MoE slides on every layer once use_sliding_window is set (no max_window_layers)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return dataclasses.replace(_qwen3(cfg), family="qwen3_moe", moe=moe, layer_windows=(window or 0,) * n)


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
    Family("Gemma 2", ("gemma2",), ("Gemma2ForCausalLM",), _gemma2),
    Family("Gemma 3 (text)", ("gemma3_text",), ("Gemma3ForCausalLM",), _gemma3),
    Family("Mixtral", ("mixtral",), ("MixtralForCausalLM",), _mixtral),
    Family("Qwen3-MoE", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), _qwen3_moe),
)


def served() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES)


def describe(cfg: dict, where: str = "config.json") -> Switches:
    """The switches of the model whose config.json is `cfg`; ValueError naming its architecture and the
    served ones when no family serves it."""
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    for f in FAMILIES:
        if model_type in f.model_types or any(a in f.architectures for a in archs):
            return dataclasses.replace(f.describe(cfg), rope=_rope(cfg, where))
    raise ValueError(f"model: {where} describes {', '.join(archs) or model_type!r} (model_type={model_type!r}), "
                     f"which loraplex does not serve; served: {served()}")
