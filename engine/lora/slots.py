"""The CPU compute working set: `max_loras` slots holding active adapters in a batch-friendly layout.

The page pool is the adapters' home (no rank padding); a slot is a copy of one resident adapter, read
from its pages through the page table when the adapter starts running, laid out so every layer's LoRA
is a few batched matmuls over slots. Rows past an adapter's rank are zero; B is pre-multiplied by the
module's scale. Per layer l (R = max_lora_rank, S = max_loras), A rows are rank-major so that
a[l, s, :r] is one contiguous [r * g, in] matrix for any r <= R:
    a_qkv[l]: [S, R, 3, H]   b_q[l]: [S, q, R]   b_k[l], b_v[l]: [S, kv, R]
    a_o[l]:   [S, R, 1, q]   b_o[l]: [S, H, R]
    a_gu[l]:  [S, R, 2, H]   b_g[l], b_u[l]: [S, I, R]
    a_d[l]:   [S, R, 1, I]   b_d[l]: [S, H, R]
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.config import LoraConfig, ModelConfig
from engine.memory import huge_zeros
from engine.lora.layout import PackedLayout, unpack_module

# group -> (A buffer, index inside it, B buffer) per module
SLOT_OF_MODULE = {"q_proj": ("a_qkv", 0, "b_q"), "k_proj": ("a_qkv", 1, "b_k"), "v_proj": ("a_qkv", 2, "b_v"),
                  "o_proj": ("a_o", 0, "b_o"), "gate_proj": ("a_gu", 0, "b_g"), "up_proj": ("a_gu", 1, "b_u"),
                  "down_proj": ("a_d", 0, "b_d")}


class LoraSlots:
    def __init__(self, lora: LoraConfig, m: ModelConfig):
        S, R, L, H, I = lora.max_loras, lora.max_lora_rank, m.num_layers, m.hidden_size, m.intermediate_size
        z = lambda *shape: huge_zeros(L, S, *shape, dtype=m.dtype)   # noqa: E731
        self.buf = {"a_qkv": z(R, 3, H), "b_q": z(m.q_size, R), "b_k": z(m.kv_size, R), "b_v": z(m.kv_size, R),
                    "a_o": z(R, 1, m.q_size), "b_o": z(H, R), "a_gu": z(R, 2, H), "b_g": z(I, R), "b_u": z(I, R),
                    "a_d": z(R, 1, I), "b_d": z(H, R)}
        self.num_slots = S
        self.slot_of: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}
        self.modules_of: dict[int, frozenset[str]] = {}   # projections the adapter has weights for
        self.lru: OrderedDict[int, None] = OrderedDict()   # adapter ids holding slots, least recent first

    def has(self, adapter_id: int) -> bool:
        return adapter_id in self.slot_of

    def can_assign(self, busy: set[int]) -> bool:
        return len(self.slot_of) < self.num_slots or any(a not in busy for a in self.lru)

    def assign(self, adapter_id: int, layout: PackedLayout, flat: torch.Tensor, busy: set[int]) -> int:
        """Copy an adapter (flat: its pages gathered in order, flattened) into a slot, replacing the least
        recently used adapter that is not in `busy`."""
        if adapter_id in self.slot_of:
            self.lru.move_to_end(adapter_id)
            return self.slot_of[adapter_id]
        if len(self.slot_of) < self.num_slots:
            slot = min(set(range(self.num_slots)) - set(self.slot_of.values()))
        else:
            victim = next(a for a in self.lru if a not in busy)
            slot = self.slot_of.pop(victim)
            self.rank_of.pop(victim)
            self.modules_of.pop(victim)
            del self.lru[victim]
        for buf in self.buf.values():
            buf[:, slot].zero_()
        for (layer, module), s in layout.modules.items():
            a, b = unpack_module(flat, s)
            a_name, idx, b_name = SLOT_OF_MODULE[module]
            self.buf[a_name][layer, slot, : s.rank, idx].copy_(a)
            self.buf[b_name][layer, slot, :, : s.rank].copy_(b * s.scale)
        self.slot_of[adapter_id] = slot
        self.rank_of[adapter_id] = max(s.rank for s in layout.modules.values())
        self.modules_of[adapter_id] = frozenset(module for _, module in layout.modules)
        self.lru[adapter_id] = None
        return slot

    def drop(self, adapter_id: int) -> None:
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.rank_of.pop(adapter_id)
            self.modules_of.pop(adapter_id)
            del self.lru[adapter_id]
