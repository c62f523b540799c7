"""An adapter's packed pages kept as int8 in the host tier (`--host-tier-dtype int8`): each group of GROUP
consecutive elements of a page row (fewer where the page is not a multiple of it) has its own fp32 scale
(its largest magnitude / 127), so a group of small values (a B row) keeps its precision beside a group of
large ones. 0.52x the bytes of bf16 (0.26x of float32): 1.94x the adapters stay warm in the same host
memory. Lossy (up to half a step of 1/127 of a group's largest value per element), hence opt-in; zeros
stay exact (the packers' gaps). Quantized on the loader thread when the host copy is taken, dequantized
on the loader thread on the way back into the pool: the step thread never does either."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128
HOST_TIER_DTYPES = ("auto", "int8")


@dataclass
class Int8Pages:
    q: torch.Tensor        # [num_pages, page_elems] int8
    scale: torch.Tensor    # [num_pages, page_elems // group] float32

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @classmethod
    def quantize(cls, packed: torch.Tensor) -> "Int8Pages":
        """packed [num_pages, page_elems] (any float dtype)."""
        n, p = packed.shape
        group = next(g for g in (GROUP, 64, 32, 16, 8, 4, 2, 1) if p % g == 0)
        x = packed.float().view(n, p // group, group)
        scale = x.abs().amax(dim=-1) / 127.0
        q = (x / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).round_().clamp_(-127, 127)
        return cls(q.to(torch.int8).view(n, p), scale)

    def dequantize(self, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """-> [num_pages, page_elems] in `dtype` (page-locked when `pin`, for a GPU's asynchronous copy)."""
        n, p = self.q.shape
        x = (self.q.view(n, p // self.group, self.group).float() * self.scale.unsqueeze(-1)).view(n, p).to(dtype)
        return x.pin_memory() if pin else x

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    @property
    def shape(self) -> torch.Size:
        return self.q.shape
