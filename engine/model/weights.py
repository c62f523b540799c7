"""Load a Hugging Face checkpoint of a served family (safetensors) into fused per-layer tensors."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from kernels.backend import Backend, LinearOp


@dataclass
class MoeWeights:
    router: LinearOp                       # [num_experts, H]
    experts: list[tuple[LinearOp, LinearOp]]   # per expert: gate_up [2 * intermediate, H], down [H, intermediate]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor     # [H]
    qkv: LinearOp                # [q_size + 2 * kv_size, H]
    o: LinearOp                  # [H, q_size]
    post_norm: torch.Tensor      # [H]
    gate_up: LinearOp | None     # [2 * I, H] (None: a mixture-of-experts layer, `moe`)
    down: LinearOp | None        # [H, I]
    qkv_bias: torch.Tensor | None = None   # [q_size + 2 * kv_size] (cfg.qkv_bias)
    q_norm: torch.Tensor | None = None     # [head_dim] (cfg.qk_norm)
    k_norm: torch.Tensor | None = None     # [head_dim]
    attn_out_norm: torch.Tensor | None = None   # [H] (cfg.sandwich_norms: the attention output's norm;
    mlp_out_norm: torch.Tensor | None = None    # the MLP output's; post_norm is then the pre-MLP norm)
    moe: MoeWeights | None = None          # cfg.moe's sparse layers: the router and experts instead of the MLP


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


def _mlp(cfg: ModelConfig, get, linear, p: str, layer: int) -> tuple:
    """Layer p's MLP: (gate_up, down, None), or (None, None, its MoeWeights) on a sparse layer."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    if cfg.moe is not None and cfg.moe.sparse[layer]:
        return None, None, _moe(cfg, get, linear, p)
    if cfg.fused_projections:                        # Phi-3: the fused layout is the checkpoint's own
        gate_up = get(p + "mlp.gate_up_proj.weight", (2 * I, H))
    else:
        gate_up = torch.cat([get(p + "mlp.gate_proj.weight", (I, H)), get(p + "mlp.up_proj.weight", (I, H))])
    return linear(gate_up), linear(get(p + "mlp.down_proj.weight", (H, I))), None


def _moe(cfg: ModelConfig, get, linear, p: str) -> MoeWeights:
    """A sparse layer's router and experts, each expert's gate and up fused as the dense MLP's."""
    spec, H = cfg.moe, cfg.hidden_size
    n = spec.intermediate
    if spec.names == "mixtral":                     # block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down)
        block, gate, up, down = p + "block_sparse_moe.", "w1", "w3", "w2"
    else:                                           # mlp.experts.E.gate_proj, up_proj, down_proj
        block, gate, up, down = p + "mlp.", "gate_proj", "up_proj", "down_proj"
    experts = []
    for e in range(spec.num_experts):
        x = f"{block}experts.{e}."
        experts.append((linear(torch.cat([get(x + f"{gate}.weight", (n, H)), get(x + f"{up}.weight", (n, H))])),
                        linear(get(x + f"{down}.weight", (H, n)))))
    return MoeWeights(router=linear(get(block + "gate.weight", (spec.num_experts, H))), experts=experts)


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

    H, q, kv, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
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
        qkv = get(p + "self_attn.qkv_proj.weight", (q + 2 * kv, H)) if cfg.fused_projections else \
            torch.cat([get(p + f"self_attn.{m}_proj.weight", (n, H)) for m, n in qkv_parts])
        gate_up, down, moe = _mlp(cfg, get, linear, p, i)
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight", H), qkv=linear(qkv),
            o=linear(get(p + "self_attn.o_proj.weight", (H, q))),
            post_norm=norm(pre_mlp, H), gate_up=gate_up, down=down, moe=moe, **extra))
    embed = get("model.embed_tokens.weight", (cfg.vocab_size, H))
    if cfg.tie_word_embeddings or "lm_head.weight" not in index:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (cfg.vocab_size, H))
    return LlamaWeights(embed=embed, layers=layers, norm=norm("model.norm.weight", H), lm_head=linear(lm_head))
