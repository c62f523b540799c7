"""The reference backend: plain torch ops, on any device torch runs on. The oracle every other backend is
tested against, and the fallback where no faster kernel applies."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.backend import Backend, ModelShape
from kernels.reference import attention
from kernels.reference.lora import ReferenceLoraStep
from kernels.reference.slots import LoraSlots


class TorchLinear:
    """y = F.linear(x, weight)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face Llama: normalise in fp32, scale in the model dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class TorchBackend(Backend):
    name = "torch"

    def linear(self, weight: torch.Tensor) -> TorchLinear:
        return TorchLinear(weight)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, d, weight, eps):
        x.add_(d)
        return rms_norm(x, weight, eps)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                 # [T, 1, d]
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        attention.write_kv(k_cache, v_cache, k, v, meta)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                  softcap: float = 0.0):
        return attention.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)

    def lora_slots(self, num_slots: int, max_rank: int, shape: ModelShape, storage: torch.Tensor) -> LoraSlots:
        return LoraSlots(num_slots, max_rank, shape, storage)

    def lora_step(self, slots: LoraSlots, token_slots: Sequence[int], num_decode: int) -> ReferenceLoraStep | None:
        return ReferenceLoraStep.build(slots, token_slots)
