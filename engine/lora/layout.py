"""Packing an adapter into pages of the unified pool, in the layout of kernels/lora_layout.py."""
from __future__ import annotations

import torch

from engine.lora.host_adapter import HostAdapter
from kernels.lora_layout import ModuleSlice, PackedLayout


def plan_layout(adapter) -> PackedLayout:
    """adapter: anything with module_shapes() -> {(layer, module): (rank, in, out, scale)} (a HostAdapter,
    or the AdapterFiles described from the header before any weight is read)."""
    off = 0
    mods = {}
    shapes = adapter.module_shapes()
    for key in sorted(shapes):
        r, n_in, n_out, scale = shapes[key]
        mods[key] = ModuleSlice(off, off + r * n_in, r, n_in, n_out, scale)
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
