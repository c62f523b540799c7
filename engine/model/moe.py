"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE) through the compute backend: the router's softmax top-k
experts per token, each expert a gated MLP over the tokens routed to it, their outputs summed with the
router's weights in ascending expert order (as transformers adds them, so float32 gives its bits).

Shapes: h [T, H] the normed residual stream -> [T, H]. Each expert's GEMMs run on its own tokens' rows
(the backend's linear: a row's result does not depend on the other rows). Which experts a step uses is
read back to the host (one transfer a layer on a GPU)."""
from __future__ import annotations

import torch

from engine.model.expert_lora import ExpertLora
from engine.model.family import MoeSpec
from engine.model.weights import MoeWeights
from kernels.backend import Backend


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], experts [T, k] int64): softmax in fp32, top k,
    renormalised when the model says so, rounded to the logits' dtype when it does (Qwen3-MoE)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top.to(logits.dtype) if spec.weights_in_dtype else top), experts


def moe_mlp(ops: Backend, h: torch.Tensor, w: MoeWeights, spec: MoeSpec, layer: int = 0,
            lora: ExpertLora | None = None) -> torch.Tensor:
    """lora: the step's adapters on the experts (engine/model/expert_lora.py), added to each expert's
    gate_up and down outputs."""
    weights, experts = route(w.router(h), spec)
    out = torch.zeros_like(h)
    for e in torch.unique(experts).tolist():                   # ascending
        rows, slot = torch.where(experts == e)
        gate_up, down = w.experts[e]
        x = h[rows]
        gu = gate_up(x)                                         # [n, 2 inter]: gate, then up
        if lora is not None:
            gu = lora.add(layer, "experts.gate_up_proj", e, rows, x, gu)
        act = ops.silu_mul(gu)
        y = down(act)                                           # [n, H]
        if lora is not None:
            y = lora.add(layer, "experts.down_proj", e, rows, act, y)
        out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
    return out
