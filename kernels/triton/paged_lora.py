"""The Triton backend's multi-LoRA: adapters are read in place in the pool's pages through a page table,
each at its own rank (S-LoRA's unified paging): no copy into slots, no padding to max_lora_rank.

`PagedAdapters` (kernels.backend.AdapterSlots) keeps, per assigned adapter, its page ids and where each
(layer, module)'s A and B start in its flat space (kernels/lora_layout.py). `PagedLoraStep`
(kernels.backend.LoraStep) stacks the step's adapters into a page table [A, max_pages] and per-(layer,
module) offset, rank and scale vectors [A], then runs, per module of a fused group: BGMV shrink and expand
for the decode tokens (one adapter index per token) and SGMV for the prefill tokens (runs of one adapter's
tokens), from kernels/triton/lora_ops.py. An adapter that lacks a module has rank 0 there: nothing is added.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.backend import InPlaceSlots
from kernels.lora_layout import GROUP_MODULES, PackedLayout, kernel_modules
from kernels.transfer import to_device
from kernels.triton import lora_ops

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class _Entry:
    pages: list[int]       # page ids, in the adapter's order (host)
    a_off: torch.Tensor    # [L, 7] int64 flat offset of A per (layer, module) (device, as the rest)
    b_off: torch.Tensor    # [L, 7] int64 flat offset of B
    rank: torch.Tensor     # [L, 7] int64, 0 where the adapter has no such module
    scale: torch.Tensor    # [L, 7] float32
    module_rank: list[int]  # [7] the largest rank of each module over the layers, 0: none (host)


class PagedAdapters(InPlaceSlots):
    """Implements kernels.backend.AdapterSlots by reference to the pool's pages (no copy). Any number of
    adapters can be assigned (`capacity` None): what runs is bounded by the pool (and max_loras if set)."""

    def __init__(self, shape, storage: torch.Tensor):
        super().__init__()
        self.storage = storage                        # [num_pages, page_elems]
        self.pool = storage.view(-1)                  # the flat pool the kernels address
        self.page_elems = storage.shape[1]
        self.num_layers = shape.num_layers
        self.out = {"q_proj": shape.q_size, "k_proj": shape.kv_size, "v_proj": shape.kv_size,
                    "o_proj": shape.hidden_size, "gate_proj": shape.intermediate_size,
                    "up_proj": shape.intermediate_size, "down_proj": shape.hidden_size}
        self.entries: dict[int, _Entry] = {}          # slot -> its adapter's page table and offsets
        self.cols = {}                                # group -> its modules' column boundaries in its output
        for group, mods in GROUP_MODULES.items():
            self.cols[group] = [0]
            for m in mods:
                self.cols[group].append(self.cols[group][-1] + self.out[m])

    def assign(self, adapter_id: int, layout: PackedLayout, pages: Sequence[int], busy: set[int]) -> int:
        if adapter_id in self.slot_of:
            return self.slot_of[adapter_id]
        slot = self.new_slot()
        shape = (self.num_layers, len(MODULES))
        a_off, b_off, rank = (torch.zeros(shape, dtype=torch.int64) for _ in range(3))
        scale = torch.zeros(shape, dtype=torch.float32)
        for (layer, module), s in kernel_modules(layout).items():
            m = MODULES.index(module)
            a_off[layer, m], b_off[layer, m], rank[layer, m], scale[layer, m] = s.a_offset, s.b_offset, s.rank, s.scale
        dev = self.storage.device
        module_rank = rank.amax(dim=0).tolist()
        self.entries[slot] = _Entry(list(pages), a_off.to(dev), b_off.to(dev), rank.to(dev), scale.to(dev),
                                    module_rank)
        self.slot_of[adapter_id] = slot
        return slot


def _runs(idx: list[int]) -> tuple[list[int], list[int]]:
    """Runs of equal values: (starts + [len], value of each run)."""
    starts, values = [], []
    for i, a in enumerate(idx):
        if not values or a != values[-1]:
            starts.append(i)
            values.append(a)
    return starts + [len(idx)], values


class PagedLoraStep:
    """Implements kernels.backend.LoraStep over PagedAdapters. Built from host-side values and copied to
    the device in a few transfers: no device-to-host sync while a step is set up."""

    def __init__(self, adapters: PagedAdapters, active: list[int], token_idx: list[int], num_decode: int):
        dev = adapters.storage.device
        entries = [adapters.entries[s] for s in active]
        self.adapters = adapters
        width = max(len(e.pages) for e in entries)
        table = torch.tensor([e.pages + [0] * (width - len(e.pages)) for e in entries], dtype=torch.int64)
        # [L, 7, A]: one contiguous vector over the step's adapters per (layer, module)
        self.a_off, self.b_off, self.rank, self.scale = (
            torch.stack([getattr(e, f) for e in entries], dim=-1).contiguous()
            for f in ("a_off", "b_off", "rank", "scale"))
        self.targets = [max(ranks) for ranks in zip(*(e.module_rank for e in entries))]   # [7] > 0: targeted
        self.max_rank = max(max(self.targets), 1)
        self.num_decode = num_decode
        starts, values = _runs(token_idx[num_decode:])
        # [A, max_pages], [D], [segments + 1], [segments]: one transfer
        self.table, self.decode_idx, self.seg_start, self.seg_adapter = to_device(
            [table, torch.tensor(token_idx[:num_decode], dtype=torch.int64),
             torch.tensor(starts, dtype=torch.int64), torch.tensor(values, dtype=torch.int64)], dev)
        self.max_seg_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        self.has_prefill = any(a >= 0 for a in values)

    @classmethod
    def build(cls, adapters: PagedAdapters, token_slots: Sequence[int], num_decode: int) -> "PagedLoraStep | None":
        active = sorted({s for s in token_slots if s >= 0})
        if not active:
            return None
        index = {s: i for i, s in enumerate(active)}
        return cls(adapters, active, [index[s] if s >= 0 else -1 for s in token_slots], num_decode)

    def project(self, linear, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        mods = GROUP_MODULES[group]
        m0 = MODULES.index(mods[0])                   # a group's modules are consecutive in MODULES
        if any(self.targets[m0:m0 + len(mods)]):
            self._add(layer, m0, len(mods), x, y, self.adapters.cols[group])
        return y

    def _add(self, layer: int, m0: int, G: int, x: torch.Tensor, y: torch.Tensor, cols: list[int]) -> None:
        """y[t, cols[g]:cols[g + 1]] += scale * B @ (A @ x[t]) of module m0 + g at `layer`, every token t and
        each of the group's G modules: one shrink and one expand launch per kind of token (decode, prefill), the
        shrinks' output unzeroed (no fill launch)."""
        pool, table, page = self.adapters.pool, self.table, self.adapters.page_elems
        a_off, b_off, rank, scale = (t[layer, m0:m0 + G] for t in (self.a_off, self.b_off, self.rank, self.scale))
        d = self.num_decode
        if d:
            v = lora_ops.bgmv_shrink(x[:d], pool, table, a_off, rank, self.decode_idx, self.max_rank, page,
                                     zero=False)
            lora_ops.bgmv_expand(v, y[:d], pool, table, b_off, rank, scale, self.decode_idx, cols, page)
        if self.has_prefill:
            xp, yp = x[d:], y[d:]
            v = lora_ops.sgmv_shrink(xp, pool, table, a_off, rank, self.seg_start, self.seg_adapter, self.max_rank,
                                     self.max_seg_len, page, zero=False)
            lora_ops.sgmv_expand(v, yp, pool, table, b_off, rank, scale, self.seg_start, self.seg_adapter, cols,
                                 self.max_seg_len, page)
