"""How an adapter is laid out in pages of the unified pool, without rank padding (the contract between the
adapter loader, which writes it, and the backends, which read it).

The adapter's flat space is the concatenation of its pages. For every (layer, module), A [r, in] and then
B [out, r] are stored row-major, one after another, in sorted (layer, module) order. Element e of the
flat space lives at page `pages[e // page_elems]`, offset `e % page_elems`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModuleSlice:
    a_offset: int
    b_offset: int
    rank: int
    n_in: int
    n_out: int
    scale: float


@dataclass(frozen=True)
class PackedLayout:
    modules: dict[tuple[int, str], ModuleSlice]   # (layer, module name, e.g. "q_proj") -> where it lies
    num_elems: int

    def num_pages(self, page_elems: int) -> int:
        return -(-self.num_elems // page_elems)


def unpack_module(flat: torch.Tensor, s: ModuleSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """flat: the adapter's pages gathered in order, flattened -> views A [r, in], B [out, r]."""
    a = flat[s.a_offset:s.a_offset + s.rank * s.n_in].view(s.rank, s.n_in)
    b = flat[s.b_offset:s.b_offset + s.rank * s.n_out].view(s.n_out, s.rank)
    return a, b
