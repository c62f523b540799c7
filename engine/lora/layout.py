"""How an adapter is packed into pages of the unified pool, without rank padding.

The adapter's flat space is the concatenation of its pages. For every (layer, module), A [r, in] and then
B [out, r] are stored row-major, one after another, in sorted (layer, module) order. Element e of the
flat space lives at page `pages[e // page_elems]`, offset `e % page_elems`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.host_adapter import HostAdapter


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
    modules: dict[tuple[int, str], ModuleSlice]
    num_elems: int

    def num_pages(self, page_elems: int) -> int:
        return -(-self.num_elems // page_elems)


def plan_layout(adapter: HostAdapter) -> PackedLayout:
    off = 0
    mods = {}
    for key in sorted(adapter.modules):
        m = adapter.modules[key]
        r, n_in = m.a.shape
        n_out = m.b.shape[0]
        mods[key] = ModuleSlice(off, off + r * n_in, r, n_in, n_out, m.scale)
        off += r * (n_in + n_out)
    return PackedLayout(mods, off)


def pack(adapter: HostAdapter, layout: PackedLayout, page_elems: int) -> torch.Tensor:
    """-> [num_pages, page_elems] in the adapter's dtype, zero-filled past the end."""
    dtype = next(iter(adapter.modules.values())).a.dtype
    flat = torch.zeros(layout.num_pages(page_elems) * page_elems, dtype=dtype)
    for key, s in layout.modules.items():
        m = adapter.modules[key]
        flat[s.a_offset:s.a_offset + m.a.numel()] = m.a.flatten()
        flat[s.b_offset:s.b_offset + m.b.numel()] = m.b.flatten()
    return flat.view(-1, page_elems)


def unpack_module(flat: torch.Tensor, s: ModuleSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """flat: the adapter's pages gathered in order, flattened -> views A [r, in], B [out, r]."""
    a = flat[s.a_offset:s.a_offset + s.rank * s.n_in].view(s.rank, s.n_in)
    b = flat[s.b_offset:s.b_offset + s.rank * s.n_out].view(s.n_out, s.rank)
    return a, b
