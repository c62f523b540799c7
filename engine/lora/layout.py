"""Packing a host adapter into pages of the unified pool, in the layout of kernels/lora_layout.py."""
from __future__ import annotations

import torch

from engine.lora.host_adapter import HostAdapter
from kernels.lora_layout import ModuleSlice, PackedLayout


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
