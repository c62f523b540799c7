"""LoRA on a mixture-of-experts layer's experts (PEFT `target_parameters`), read where it rests in the pool.

PEFT adapts the stack of E expert weights W [E, out, in] with one LoRA of rank E * r: A [E r, in] and
B [out, E r], expert e's factors A_e = A[e r : e r + r] and B_e = B[:, k E + e] (k < r), so that expert e
computes x (W_e + s B_e A_e)^T. Here the base expert runs as before and each row adds
s (x A_e^T) B_e^T of its own adapter (kernels/lora_layout.py: such modules lie row-major in the adapter's
pages). Only the experts a step routes tokens to are read, each (adapter, layer, expert) once a step.

Rows of other adapters, or of none, get the same product times a zero mask: exactly +0 (the weights are
checked finite at load), so a row's result never depends on its batch, and nothing is read back to the
host. Runs on every backend as torch ops (the mixture-of-experts layers run op by op).

Shapes: x [n, in] the expert's rows, y [n, out] its output; rows [n] their indices in the step's tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.lora_layout import ModuleSlice, PackedLayout


@dataclass
class _Placed:
    layout: PackedLayout
    pages: torch.Tensor           # [num_pages] int64, on the pool's device


class ExpertLora:
    def __init__(self, storage: torch.Tensor, num_experts: int, row_adapter: torch.Tensor, adapters: list[_Placed]):
        self.flat = storage.view(-1)               # the pool, [num_pages * page_elems]
        self.page_elems = storage.shape[1]
        self.num_experts = num_experts
        self.row_adapter = row_adapter             # [T] int64: index into `adapters`, -1 for none
        self.adapters = adapters

    @classmethod
    def build(cls, storage: torch.Tensor, num_experts: int, token_adapters: Sequence[int],
              placement: Callable[[int], tuple[PackedLayout, Sequence[int]]]) -> "ExpertLora | None":
        """token_adapters: each token's adapter id (0: none); placement(id) -> its layout and pages. None when
        no adapter of the step adapts experts."""
        index: dict[int, int] = {}
        adapters: list[_Placed] = []
        dev = storage.device
        for aid in dict.fromkeys(token_adapters):
            if aid:
                layout, pages = placement(aid)
                if layout.has_experts:
                    index[aid] = len(adapters)
                    adapters.append(_Placed(layout, torch.tensor(list(pages), dtype=torch.int64, device=dev)))
        if not adapters:
            return None
        rows = torch.tensor([index.get(a, -1) for a in token_adapters], dtype=torch.int64, device=dev)
        return cls(storage, num_experts, rows, adapters)

    def add(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
            y: torch.Tensor) -> torch.Tensor:
        """y + each row's s (x A_e^T) B_e^T for module `module` of expert `expert` at `layer`."""
        owner = self.row_adapter[rows]
        for j, placed in enumerate(self.adapters):
            s = placed.layout.modules.get((layer, module))
            if s is None:
                continue
            a, b = self._factors(placed.pages, s, expert)                    # [r, in], [out, r]
            mask = (owner == j).to(torch.float32)[:, None]
            delta = (x.float() @ a.float().T) @ b.float().T * s.scale      # [n, out]
            y = y + (delta * mask).to(y.dtype)
        return y

    def _factors(self, pages: torch.Tensor, s: ModuleSlice, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        E = self.num_experts
        r = s.rank // E
        dev = pages.device
        a_idx = s.a_offset + e * r * s.n_in + torch.arange(r * s.n_in, device=dev)
        k = torch.arange(r, device=dev)
        o = torch.arange(s.n_out, device=dev)
        b_idx = s.b_offset + o[:, None] * (E * r) + k[None, :] * E + e                 # [out, r]
        return self._gather(pages, a_idx).view(r, s.n_in), self._gather(pages, b_idx.flatten()).view(s.n_out, r)

    def _gather(self, pages: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Elements `idx` of the adapter's flat space (its pages in order), from the pool."""
        return self.flat[pages[idx // self.page_elems] * self.page_elems + idx % self.page_elems]
