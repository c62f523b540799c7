"""Load a Hugging Face checkpoint of a served family (safetensors) into fused per-layer tensors."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from kernels.backend import Backend, LinearOp


@dataclass
class LayerWeights:
    input_norm: torch.Tensor     # [H]
    qkv: LinearOp                # [q_size + 2 * kv_size, H]
    o: LinearOp                  # [H, q_size]
    post_norm: torch.Tensor      # [H]
    gate_up: LinearOp            # [2 * I, H]
    down: LinearOp               # [H, I]
    qkv_bias: torch.Tensor | None = None   # [q_size + 2 * kv_size] (cfg.qkv_bias)
    q_norm: torch.Tensor | None = None     # [head_dim] (cfg.qk_norm)
    k_norm: torch.Tensor | None = None     # [head_dim]
    attn_out_norm: torch.Tensor | None = None   # [H] (cfg.sandwich_norms: the attention output's norm;
    mlp_out_norm: torch.Tensor | None = None    # the MLP output's; post_norm is then the pre-MLP norm)


@dataclass
class LlamaWeights:
    embed: torch.Tensor          # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor           # [H]
    lm_head: LinearOp            # [V, H] (the embedding's values when tied)


def _open_all(path: Path) -> dict[str, tuple]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {path} has no *.safetensors weights (pickled .bin files are not loaded)")
    index = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            index[name] = handle
    return index


def load_weights(cfg: ModelConfig, backend: Backend) -> LlamaWeights:
    """Read the checkpoint; every projection packed by `backend.linear`."""
    linear = backend.linear
    index = _open_all(Path(cfg.path))

    def get(name: str, shape: tuple[int, ...], offset: float = 0.0) -> torch.Tensor:
        if name not in index:
            raise ValueError(f"model: weight {name!r} is missing from {cfg.path}")
        t = index[name].get_tensor(name)
        if tuple(t.shape) != shape:
            raise ValueError(f"model: weight {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        if offset:
            t = offset + t.float()
        return t.to(dtype=cfg.dtype, device=backend.device)

    def norm(name: str, n: int) -> torch.Tensor:
        """An RMSNorm weight as the kernels apply it: 1 + w (added in fp32) where the family stores w (Gemma)."""
        return get(name, (n,), 1.0 if cfg.norm_offset else 0.0)

    H, I, q, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        extra, qkv_parts = {}, (("q", q), ("k", kv), ("v", kv))
        if cfg.qkv_bias:
            extra["qkv_bias"] = torch.cat([get(p + f"self_attn.{m}_proj.bias", (n,)) for m, n in qkv_parts])
        if cfg.qk_norm:
            extra["q_norm"] = norm(p + "self_attn.q_norm.weight", d)
            extra["k_norm"] = norm(p + "self_attn.k_norm.weight", d)
        if cfg.sandwich_norms:       # Gemma: post_attention_layernorm norms the attention's output
            extra["attn_out_norm"] = norm(p + "post_attention_layernorm.weight", H)
            extra["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight", H)
        pre_mlp = p + ("pre_feedforward_layernorm.weight" if cfg.sandwich_norms else "post_attention_layernorm.weight")
        if cfg.fused_projections:        # Phi-3: the fused layout is the checkpoint's own
            qkv = get(p + "self_attn.qkv_proj.weight", (q + 2 * kv, H))
            gate_up = get(p + "mlp.gate_up_proj.weight", (2 * I, H))
        else:
            qkv = torch.cat([get(p + f"self_attn.{m}_proj.weight", (n, H)) for m, n in qkv_parts])
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight", (I, H)), get(p + "mlp.up_proj.weight", (I, H))])
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight", H), qkv=linear(qkv),
            o=linear(get(p + "self_attn.o_proj.weight", (H, q))),
            post_norm=norm(pre_mlp, H), gate_up=linear(gate_up),
            down=linear(get(p + "mlp.down_proj.weight", (H, I))), **extra))
    embed = get("model.embed_tokens.weight", (cfg.vocab_size, H))
    if cfg.tie_word_embeddings or "lm_head.weight" not in index:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (cfg.vocab_size, H))
    return LlamaWeights(embed=embed, layers=layers, norm=norm("model.norm.weight", H), lm_head=linear(lm_head))
