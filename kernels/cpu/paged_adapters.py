"""The CPU backend's adapters, read in place in the pool's pages (kernels.backend.AdapterSlots).

Nothing is copied when an adapter starts running: `assign` records, per (layer, fused group), the addresses
of its blocks in its pages (kernels/cpu/lora_pack.py's layout), and a step stacks the addresses of its
adapters into the pointer tables its C kernels read (lora.Weights). So a step may hold any number of
distinct adapters (`capacity` None: the pool, and max_loras if set, bound it), each read at its own rank.
What an adapter lacks (a layer, a fused group, one projection of a group) points at a shared zero block: its
tokens read zeros there and add nothing, as PEFT adds nothing for a module it does not adapt.
The addresses stay valid while the adapter is assigned: the engine evicts only adapters that no running
request uses, and drops their assignment first (AdapterManager.on_drop).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import InPlaceSlots
from kernels.cpu import lora as c_lora
from kernels.lora_layout import GROUP_MODULES, PackedLayout, kernel_modules

GROUPS = tuple(GROUP_MODULES)          # qkv, o, gate_up, down: the column of a group in the address tables


class CpuPagedAdapters(InPlaceSlots):
    def __init__(self, max_rank: int, shape, storage: torch.Tensor):
        super().__init__()
        self.storage = storage                     # the pool [num_pages, page_elems]
        self.dtype = shape.dtype
        self.max_rank = max_rank
        self.num_layers = shape.num_layers
        self.page_elems = storage.shape[1]
        self.paired = c_lora.pairs_b(shape.dtype)
        H, Q, KV, I = shape.hidden_size, shape.q_size, shape.kv_size, shape.intermediate_size
        self.n_in = {"qkv": H, "o": Q, "gate_up": H, "down": I}
        self.outs = {"qkv": [Q, KV, KV], "o": [H], "gate_up": [I, I], "down": [H]}
        self.max_in = max(H, Q, I)
        self.shapes = {g: c_lora.GroupShape(self.n_in[g], self.outs[g]) for g in GROUPS}
        r = max_rank + 1
        self.zeros = torch.zeros(max(r * 3 * self.max_in, r * max(Q, H, I)), dtype=shape.dtype)
        self.rank_of: dict[int, int] = {}
        self.modules_of: dict[int, frozenset[str]] = {}
        self.entries: dict[int, torch.Tensor] = {}     # slot -> [L, 4 groups, 1 + 3] int64 addresses (A, Bt_g)
        self.placed: dict[int, tuple[PackedLayout, list[int]]] = {}   # slot -> layout, pages (torch fallback)

    # -- AdapterSlots -----------------------------------------------------------------------------------
    def assign(self, adapter_id: int, layout: PackedLayout, pages: Sequence[int], busy: set[int]) -> int:
        if adapter_id in self.slot_of:
            return self.slot_of[adapter_id]
        if not layout.blocks and kernel_modules(layout):
            raise ValueError("the CPU backend reads adapters packed by its own packer (kernels/cpu/lora_pack.py)")
        slot = self.new_slot()
        zero = self.zeros.data_ptr()
        table = [[[zero] * 4 for _ in GROUPS] for _ in range(self.num_layers)]
        for (layer, group), blk in layout.blocks.items():
            row = table[layer][GROUPS.index(group)]
            row[0] = self._address(blk.a_offset, pages)
            for i, off in enumerate(blk.b_offsets):
                if off >= 0:
                    row[1 + i] = self._address(off, pages)
        self.entries[slot] = torch.tensor(table, dtype=torch.int64)
        self.placed[slot] = (layout, list(pages))
        self.slot_of[adapter_id] = slot
        self.rank_of[adapter_id] = max((b.rank for b in layout.blocks.values()), default=0)
        self.modules_of[adapter_id] = frozenset(module for _, module in kernel_modules(layout))
        return slot

    def _address(self, offset: int, pages: Sequence[int]) -> int:
        page, within = divmod(offset, self.page_elems)
        return self.storage.data_ptr() + (pages[page] * self.page_elems + within) * self.storage.element_size()

    def drop(self, adapter_id: int) -> None:
        if adapter_id in self.slot_of:
            self.rank_of.pop(adapter_id)
            self.modules_of.pop(adapter_id)
        super().drop(adapter_id)

    def dropped(self, slot: int) -> None:
        del self.placed[slot]

    def adapter_of_slot(self) -> dict[int, int]:
        return {s: a for a, s in self.slot_of.items()}

    def groups_of(self, adapter_ids) -> set[str]:
        """The fused groups some of these adapters target (the others are skipped in a step)."""
        modules = frozenset().union(*(self.modules_of[a] for a in adapter_ids))
        return {g for g, mods in GROUP_MODULES.items() if modules.intersection(mods)}

    # -- a step's tables --------------------------------------------------------------------------------
    def tables(self, slots: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The step's adapters in this order (step index j = position in `slots`) -> per group (a [L, S] A
        addresses, b [L, S * G] Bt addresses, b[l, j * G + g])."""
        e = torch.stack([self.entries[s] for s in slots])                      # [S, L, 4, 4]
        out = {}
        for gi, group in enumerate(GROUPS):
            G = len(GROUP_MODULES[group])
            a = e[:, :, gi, 0].T.contiguous()                                    # [L, S]
            b = e[:, :, gi, 1:1 + G].permute(1, 0, 2).reshape(self.num_layers, -1).contiguous()   # [L, S * G]
            out[group] = (a, b)
        return out

    def weights(self, tables, layer: int, group: str, max_rank: int) -> c_lora.Weights:
        a, b = tables[group]                    # contiguous [L, S] and [L, S * G] int64: rows by address
        return c_lora.Weights(a.data_ptr() + layer * a.stride(0) * 8, b.data_ptr() + layer * b.stride(0) * 8,
                              max_rank, self.shapes[group], self.paired, self.dtype, keep=tables)

    # -- reading a block as tensors (the torch fallback, tests) ----------------------------------------
    def block(self, slot: int, layer: int, group: str) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Slot's A [R, G, in] and plain Bt_g [R, out_g] (copies of paired ones) at (layer, group), or None."""
        layout, pages = self.placed[slot]
        blk = layout.blocks.get((layer, group))
        if blk is None:
            return None
        flat = self.storage.view(-1)
        R, G, n_in = blk.rank, len(GROUP_MODULES[group]), self.n_in[group]

        def at(offset: int, n: int) -> torch.Tensor:
            page, within = divmod(offset, self.page_elems)
            start = pages[page] * self.page_elems + within
            return flat[start:start + n]
        a = at(blk.a_offset, R * G * n_in).view(R, G, n_in)
        bs = []
        for off, out in zip(blk.b_offsets, self.outs[group]):
            if off < 0:
                bs.append(torch.zeros(R, out, dtype=self.dtype))
            elif self.paired:
                P = (R + 1) // 2
                bs.append(c_lora.unpair_rows(at(off, P * out * 2).view(P, out, 2))[:R])
            else:
                bs.append(at(off, R * out).view(R, out))
        return a, bs
