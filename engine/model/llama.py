"""The Llama forward pass over a paged KV cache, in plain torch ops.

Tokens of all scheduled requests are flattened into one batch of T tokens: x is [T, hidden]. Multi-LoRA
deltas are added by a `LoraHook` right after each base projection, on the fused outputs.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine import envs
from engine.config import ModelConfig
from engine.model.attention import AttentionMetadata, paged_attention, write_kv
from engine.model.linear import Linear
from engine.model.rope import Rope
from engine.model.weights import LlamaWeights
from kernels.cpu import elementwise
from kernels.cpu.decoder import Decoder, DecoderLora
from kernels.cpu.gemm import GemmLora


class LoraHook(Protocol):
    def fused(self, layer: int, group: str) -> GemmLora | None:
        """Deltas a C base GEMM can add itself (some tokens'), or None."""

    def for_decoder(self) -> DecoderLora | None:
        """The step's adapters for the one-call C decoder, or None when some delta needs the Python path."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, fused: bool = False) -> None:
        """Add the adapters' deltas in place: y[t] += lora_{group}(x[t]) for every token t (but those of
        `fused()`'s when fused). group is "qkv", "o", "gate_up" or "down"; x: [T, in], y: [T, out]."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face Llama: normalise in fp32, scale in the model dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class TorchOps:
    """The elementwise steps of a layer in torch ops; `kernels.cpu.elementwise` fuses each into one pass
    with the same rounding (CFusedOps)."""
    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += d in place (the residual stream), then rms_norm(x)."""
        x.add_(d)
        return rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope(rope: Rope, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, d]; cos, sin: [T, d] -> rotated (a copy)."""
        return rope.apply(x, cos.unsqueeze(1), sin.unsqueeze(1))

    write_kv = staticmethod(write_kv)


class CFusedOps:
    rms_norm = staticmethod(elementwise.rms_norm)
    add_rms_norm = staticmethod(elementwise.add_rms_norm)
    silu_mul = staticmethod(elementwise.silu_mul)

    @staticmethod
    def rope(rope: Rope, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return elementwise.rope_(x, cos, sin)     # in place: x is a view of this step's fused qkv

    @staticmethod
    def write_kv(k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        if meta.paired:
            write_kv(k_cache, v_cache, k, v, meta)
            return
        elementwise.write_kv(k_cache, v_cache, k, v, meta.slot_page, meta.slot_offset)


def project(linear: Linear, layer: int, group: str, x: torch.Tensor, lora: LoraHook | None) -> torch.Tensor:
    """linear(x) plus the adapters' deltas of that group."""
    if lora is None:
        return linear(x)
    fused = lora.fused(layer, group) if linear.takes_lora else None
    y = linear(x, fused)
    lora.apply(layer, group, x, y, fused=fused is not None)
    return y


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: LlamaWeights):
        self.cfg = cfg
        self.w = weights
        self.rope = Rope(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, cfg.dtype)
        self.scale = cfg.head_dim ** -0.5
        self.ops = CFusedOps if elementwise.supports(cfg.dtype) else TorchOps
        self.use_c_decoder = envs.c_decoder()
        self._decoder: tuple[list, Decoder | None] | None = None   # (the kv_caches it was built for, it)

    def decoder(self, kv_caches) -> Decoder | None:
        """The one-call C decoder (kernels/cpu/decoder.c) over these caches, or None where it cannot run
        (or use_c_decoder is off)."""
        if not self.use_c_decoder:
            return None
        if self._decoder is None or self._decoder[0] is not kv_caches:
            self._decoder = (kv_caches, Decoder.create(self.cfg, self.w.layers, kv_caches))
        return self._decoder[1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
                lora: LoraHook | None = None, hidden_indices: torch.Tensor | None = None):
        """input_ids, positions: [T]; logits_indices: [S] rows to project -> logits [S, vocab] in the model
        dtype (the sampler converts what it needs to fp32: a bf16 greedy step never does).
        With hidden_indices [P]: -> (logits, those rows' final normed hidden states [P, H]) for the caller
        to project in pieces (prompt logprobs, see logits_of)."""
        cfg, ops = self.cfg, self.ops
        x = F.embedding(input_ids, self.w.embed)                     # [T, H], the residual stream
        cos, sin = self.rope.cos[positions], self.rope.sin[positions]   # [T, head_dim]
        decoder = self.decoder(kv_caches) if meta.paired else None
        dl = lora.for_decoder() if decoder is not None and lora is not None else None
        if decoder is not None and (lora is None or dl is not None):
            x += decoder.run(x, cos, sin, meta, dl)     # _layers' loop in one C call: the same bits
        else:
            self._layers(x, cos, sin, meta, kv_caches, lora)
        if hidden_indices is not None:
            hidden = ops.rms_norm(x[hidden_indices], self.w.norm, cfg.rms_norm_eps)
        x = ops.rms_norm(x[logits_indices], self.w.norm, cfg.rms_norm_eps)
        logits = self.w.lm_head(x)
        return logits if hidden_indices is None else (logits, hidden)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_caches,
                lora: LoraHook | None) -> None:
        """The decoder layers, op by op: x [T, H] (the embeddings) becomes the final residual stream."""
        cfg, ops, layers = self.cfg, self.ops, self.w.layers
        h = ops.rms_norm(x, layers[0].input_norm, cfg.rms_norm_eps)
        for i, layer in enumerate(layers):
            qkv = project(layer.qkv, i, "qkv", h, lora)           # [T, q + 2kv]
            q_k = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q_k = ops.rope(self.rope, q_k, cos, sin)                # q and k heads in one pass
            q, k = q_k.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_caches[i]
            ops.write_kv(k_cache, v_cache, k, v, meta)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale).flatten(1)  # [T, q]
            o = project(layer.o, i, "o", attn, lora)
            h = ops.add_rms_norm(x, o, layer.post_norm, cfg.rms_norm_eps)         # x += o
            gate_up = project(layer.gate_up, i, "gate_up", h, lora)  # [T, 2I]
            act = ops.silu_mul(gate_up)                               # [T, I]
            down = project(layer.down, i, "down", act, lora)
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, down, layers[i + 1].input_norm, cfg.rms_norm_eps)   # x += down
            else:
                x += down

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [P, H] -> logits [P, vocab] fp32."""
        return self.w.lm_head(hidden).float()
