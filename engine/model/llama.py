"""The decoder forward pass over a paged KV cache, through a compute backend (kernels/backend.py): the
Llama layer with its family's switches (engine/model/family.py: q/k/v biases, q/k norms, sliding windows).

Tokens of all scheduled requests are flattened into one batch of T tokens: x is [T, hidden]. Multi-LoRA
deltas come with each base projection (`LoraStep.project`), on the fused outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.dora_scales import DoraScales
from engine.model.expert_lora import ExpertLora
from engine.model.moe import moe_mlp
from engine.model.rope import Rope
from engine.model.weights import LlamaWeights
from kernels.attention_metadata import AttentionMetadata
from kernels.backend import Backend, FusedDecoder, LinearOp, LoraStep


def project(linear: LinearOp, layer: int, group: str, x: torch.Tensor, lora: LoraStep | None,
            dora: DoraScales | None = None) -> torch.Tensor:
    """linear(x) plus the adapters' deltas of that group, DoRA rows rescaled (engine/model/dora_scales.py)."""
    y = linear(x) if lora is None else lora.project(linear, layer, group, x)
    return y if dora is None else dora.apply(layer, group, y)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: LlamaWeights, backend: Backend, use_fused_decoder: bool = True):
        self.cfg = cfg
        self.w = weights
        self.backend = backend
        self.rope = self._rope(cfg.rope_theta, cfg.rope_scaling)
        # the sliding layers' own RoPE (Gemma 3), or None: every layer uses self.rope
        self.local_rope = self._rope(cfg.local_rope_theta, cfg.local_rope_scaling) if cfg.local_rope_theta else None
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.use_fused_decoder = use_fused_decoder
        self._decoder: tuple[list, FusedDecoder | None] | None = None   # (the kv_caches it was built for, it)

    def _rope(self, theta: float, scaling: dict | None) -> Rope:
        rope = Rope(self.cfg.head_dim, self.cfg.max_model_len, theta, scaling, self.cfg.dtype)
        rope.cos, rope.sin = rope.cos.to(self.backend.device), rope.sin.to(self.backend.device)
        return rope

    def tables(self, positions: torch.Tensor) -> tuple:
        """(cos, sin) [T, head_dim] of every layer, and of the sliding layers when they have their own
        RoPE (else None), gathered once a step."""
        glob = (self.rope.cos[positions], self.rope.sin[positions])
        if self.local_rope is None:
            return glob, None
        return glob, (self.local_rope.cos[positions], self.local_rope.sin[positions])

    def decoder(self, kv_caches) -> FusedDecoder | None:
        """The backend's fused whole-step decoder over these caches, or None where it has none (or
        use_fused_decoder is off)."""
        if not self.use_fused_decoder:
            return None
        if self._decoder is None or self._decoder[0] is not kv_caches:
            self._decoder = (kv_caches, self.backend.decoder(self.cfg, self.w.layers, kv_caches))
        return self._decoder[1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                lora: LoraStep | None = None, hidden_indices: torch.Tensor | None = None,
                experts: ExpertLora | None = None, dora: DoraScales | None = None):
        """input_ids, positions: [T]; logits_indices: [S] rows to project -> logits [S, vocab] in the model
        dtype (the sampler converts what it needs to fp32: a bf16 greedy step never does).
        With hidden_indices [P]: -> (logits, those rows' final normed hidden states [P, H]) for the caller
        to project in pieces (prompt logprobs, see logits_of). experts: the step's LoRA on the experts of a
        mixture-of-experts model (engine/model/expert_lora.py), if any adapter of the step has one."""
        cfg, ops = self.cfg, self.backend
        x = F.embedding(input_ids, self.w.embed)                     # [T, H], the residual stream
        if cfg.embed_scale:                                          # Gemma: sqrt(H), rounded to the dtype
            x *= torch.tensor(cfg.hidden_size ** 0.5, dtype=x.dtype)
        tables, local = self.tables(positions)                       # [T, head_dim] each
        decoder = self.decoder(kv_caches)
        if decoder is not None and experts is None and decoder.accepts(meta, lora):
            x += decoder.run(x, *tables, meta, lora, local, dora)   # _layers' loop in one call: the same bits
        else:
            self._layers(x, tables, local, meta, kv_caches, lora, experts, dora)
        if hidden_indices is not None:
            hidden = ops.rms_norm(x[hidden_indices], self.w.norm, cfg.rms_norm_eps)
        x = ops.rms_norm(x[logits_indices], self.w.norm, cfg.rms_norm_eps)
        logits = self.softcap(self.w.lm_head(x))
        return logits if hidden_indices is None else (logits, hidden)

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-cap, cap * tanh(logits / cap), in the logits' dtype (as transformers)."""
        cap = self.cfg.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _layers(self, x: torch.Tensor, tables: tuple, local: tuple | None, meta: AttentionMetadata, kv_caches,
                lora: LoraStep | None, experts: ExpertLora | None = None, dora: DoraScales | None = None) -> None:
        """The decoder layers, op by op: x [T, H] (the embeddings) becomes the final residual stream.
        tables: (cos, sin) [T, head_dim]; local: the sliding layers' own, or None."""
        cfg, ops, layers = self.cfg, self.backend, self.w.layers
        act = ops.gelu_tanh_mul if cfg.activation == "gelu_tanh" else ops.silu_mul
        h = ops.rms_norm(x, layers[0].input_norm, cfg.rms_norm_eps)
        for i, layer in enumerate(layers):
            cos, sin = local if local is not None and cfg.window(i) else tables
            qkv = project(layer.qkv, i, "qkv", h, lora, dora)           # [T, q + 2kv]
            if layer.qkv_bias is not None:
                qkv = ops.add_bias(qkv, layer.qkv_bias)
            q_k = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q_k = ops.head_norms(q_k, cfg.num_heads, layer.q_norm, layer.k_norm, cfg.rms_norm_eps)
            q_k = ops.rope(q_k, cos, sin)                           # q and k heads in one pass
            q, k = q_k.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_caches[i]
            ops.write_kv(k_cache, v_cache, k, v, meta)
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale, cfg.window(i), cfg.attn_softcap)
            o = project(layer.o, i, "o", attn.flatten(1), lora, dora)      # [T, H]
            if layer.attn_out_norm is not None:                      # sandwich norms (Gemma)
                o = ops.rms_norm(o, layer.attn_out_norm, cfg.rms_norm_eps)
            h = ops.add_rms_norm(x, o, layer.post_norm, cfg.rms_norm_eps)         # x += o
            if layer.moe is not None:                                # the experts, with their LoRA if any
                down = moe_mlp(ops, h, layer.moe, cfg.moe, i, experts)
            else:
                gate_up = project(layer.gate_up, i, "gate_up", h, lora, dora)  # [T, 2I]
                down = project(layer.down, i, "down", act(gate_up), lora, dora)   # act: [T, I]
            if layer.mlp_out_norm is not None:
                down = ops.rms_norm(down, layer.mlp_out_norm, cfg.rms_norm_eps)
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, down, layers[i + 1].input_norm, cfg.rms_norm_eps)   # x += down
            else:
                x += down

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [P, H] -> logits [P, vocab] fp32."""
        return self.softcap(self.w.lm_head(hidden)).float()
