"""The reference backend's adapters (the oracle): `num_slots` slots holding active adapters in a batch-friendly
layout; with num_slots None (max_loras unset) the slots grow as a step needs more, so no count bounds a
step but the pool's. The CPU and Triton backends read adapters in place instead.

The page pool is the adapters' home (no rank padding); a slot is a copy of one resident adapter, read
from its pages through the page table when the adapter starts running, laid out so every layer's LoRA
is a few batched matmuls over slots. Rows past an adapter's rank are zero; B is pre-multiplied by the
module's scale and stored transposed. Per layer l (R = max rank, S = slots), both are rank-major, so that
a[l, s, :r] is one contiguous [r * g, in] matrix and b[l, s, :r] one contiguous [r, out] matrix for any
r <= R (an adapter of rank r streams exactly its own bytes). A subclass may store B in another layout
(`_store_b` / `b_rows`; the CPU backend pairs ranks for vdpbf16ps):
    a_qkv[l]: [S, R, 3, H]   b_q[l]: [S, R, q]   b_k[l], b_v[l]: [S, R, kv]
    a_o[l]:   [S, R, 1, q]   b_o[l]: [S, R, H]
    a_gu[l]:  [S, R, 2, H]   b_g[l], b_u[l]: [S, R, I]
    a_d[l]:   [S, R, 1, I]   b_d[l]: [S, R, H]
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from kernels.lora_layout import PackedLayout, kernel_modules, unpack_module
from kernels.memory import huge_zeros

# module -> (A buffer, index inside it, B buffer)
SLOT_OF_MODULE = {"q_proj": ("a_qkv", 0, "b_q"), "k_proj": ("a_qkv", 1, "b_k"), "v_proj": ("a_qkv", 2, "b_v"),
                  "o_proj": ("a_o", 0, "b_o"), "gate_proj": ("a_gu", 0, "b_g"), "up_proj": ("a_gu", 1, "b_u"),
                  "down_proj": ("a_d", 0, "b_d")}

# fused group -> (A buffer, B buffers in output order, the projections they hold)
GROUPS = {"qkv": ("a_qkv", ("b_q", "b_k", "b_v"), ("q_proj", "k_proj", "v_proj")), "o": ("a_o", ("b_o",), ("o_proj",)),
          "gate_up": ("a_gu", ("b_g", "b_u"), ("gate_proj", "up_proj")), "down": ("a_d", ("b_d",), ("down_proj",))}


class LoraSlots:
    """Implements kernels.backend.AdapterSlots in the plain layout above."""

    def __init__(self, num_slots: int | None, max_rank: int, shape, storage: torch.Tensor):
        self.storage = storage               # the page pool [num_pages, page_elems]
        self.capacity = num_slots            # None: grow (_grow) rather than refuse
        S, R, L, H, I = num_slots or 4, max_rank, shape.num_layers, shape.hidden_size, shape.intermediate_size
        self.num_slots = S
        self.dtype = shape.dtype
        self.max_rank = R
        self.max_in = max(H, shape.q_size, I)      # the widest input a LoRA A reads
        z = lambda *dims: self._zeros(L, S, *dims)   # noqa: E731
        self.buf = {"a_qkv": z(R, 3, H), "a_o": z(R, 1, shape.q_size), "a_gu": z(R, 2, H), "a_d": z(R, 1, I)}
        for name, out in (("b_q", shape.q_size), ("b_k", shape.kv_size), ("b_v", shape.kv_size), ("b_o", H),
                          ("b_g", I), ("b_u", I), ("b_d", H)):
            self.buf[name] = self._b_buffer(L, S, R, out)
        self.slot_of: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}
        self.modules_of: dict[int, frozenset[str]] = {}   # projections the adapter has weights for
        self.lru: OrderedDict[int, None] = OrderedDict()   # adapter ids holding slots, least recent first

    def _zeros(self, *shape: int) -> torch.Tensor:
        """A long-lived buffer beside the pool: huge pages on the host, else on the pool's device."""
        if self.storage.device.type == "cpu":
            return huge_zeros(*shape, dtype=self.dtype)
        return torch.zeros(*shape, dtype=self.dtype, device=self.storage.device)

    # -- the B layout (a subclass may change it) --------------------------------------------------------
    def _b_buffer(self, layers: int, slots: int, rank: int, out: int) -> torch.Tensor:
        return self._zeros(layers, slots, rank, out)

    def _store_b(self, name: str, layer: int, slot: int, bt: torch.Tensor) -> None:
        """bt: [r, out] (B^T, pre-scaled) -> the first r rows of slot `slot`."""
        self.buf[name][layer, slot, : bt.shape[0]].copy_(bt)

    def b_rows(self, name: str, layer: int, slots: slice | torch.Tensor | int, r: int) -> torch.Tensor:
        """The first r rows of B buffer `name` (Bt, pre-scaled) of some slots: [..., r, out]."""
        return self.buf[name][layer, slots][..., :r, :]

    # -- AdapterSlots -----------------------------------------------------------------------------------
    def has(self, adapter_id: int) -> bool:
        return adapter_id in self.slot_of

    def can_assign(self, busy: set[int]) -> bool:
        return self.capacity is None or len(self.slot_of) < self.num_slots or any(a not in busy for a in self.lru)

    def _grow(self) -> None:
        """Twice the slots (unbounded slots only), the assigned adapters kept where they are."""
        for name, buf in self.buf.items():
            bigger = self._zeros(*buf.shape[:1], 2 * buf.shape[1], *buf.shape[2:])
            bigger[:, : buf.shape[1]].copy_(buf)
            self.buf[name] = bigger
        self.num_slots *= 2

    def assign(self, adapter_id: int, layout: PackedLayout, pages, busy: set[int]) -> int:
        """Copy an adapter from its pages into a slot, replacing the least recently used adapter that is not
        in `busy`."""
        if adapter_id in self.slot_of:
            self.lru.move_to_end(adapter_id)
            return self.slot_of[adapter_id]
        if len(self.slot_of) >= self.num_slots and self.capacity is None:
            self._grow()
        if len(self.slot_of) < self.num_slots:
            slot = min(set(range(self.num_slots)) - set(self.slot_of.values()))
        else:
            victim = next(a for a in self.lru if a not in busy)
            slot = self.slot_of[victim]
            self.drop(victim)
        for buf in self.buf.values():
            buf[:, slot].zero_()
        # read the adapter through its page table: its pages gathered in order, flattened
        index = torch.tensor(list(pages), dtype=torch.long, device=self.storage.device)
        flat = self.storage.index_select(0, index).flatten()
        mods = kernel_modules(layout)
        for (layer, module), s in mods.items():
            a, b = unpack_module(flat, s)
            a_name, idx, b_name = SLOT_OF_MODULE[module]
            self.buf[a_name][layer, slot, : s.rank, idx].copy_(a)
            self._store_b(b_name, layer, slot, (b * s.scale).T)                  # [r, out]
        self.slot_of[adapter_id] = slot
        self.rank_of[adapter_id] = max((s.rank for s in mods.values()), default=0)
        self.modules_of[adapter_id] = frozenset(module for _, module in mods)
        self.lru[adapter_id] = None
        return slot

    def drop(self, adapter_id: int) -> None:
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.rank_of.pop(adapter_id)
            self.modules_of.pop(adapter_id)
            del self.lru[adapter_id]

    def adapter_of_slot(self) -> dict[int, int]:
        return {s: a for a, s in self.slot_of.items()}

    def groups_of(self, adapter_ids) -> set[str]:
        """The fused groups some of these adapters target (the others are skipped in a step)."""
        modules = frozenset().union(*(self.modules_of[a] for a in adapter_ids))
        return {g for g, (_, _, mods) in GROUPS.items() if modules.intersection(mods)}
