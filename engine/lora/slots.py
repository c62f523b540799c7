"""The CPU compute working set: `max_loras` slots holding active adapters in a batch-friendly layout.

The page pool is the adapters' home (no rank padding); a slot is a copy of one resident adapter, read
from its pages through the page table when the adapter starts running, laid out so every layer's LoRA
is a few batched matmuls over slots. Rows past an adapter's rank are zero; B is pre-multiplied by the
module's scale and stored transposed. Per layer l (R = max_lora_rank, S = max_loras), both are
rank-major, so that a[l, s, :r] is one contiguous [r * g, in] matrix and b[l, s, :r] one contiguous
[r, out] matrix for any r <= R (an adapter of rank r streams exactly its own bytes). Where the bf16 C
kernels read B two ranks at a time (`paired`, kernels/cpu/lora_bf16.h), each B is [S, ceil(R / 2), out, 2]
instead (`b_rows` gives [r, out] in either layout):
    a_qkv[l]: [S, R, 3, H]   b_q[l]: [S, R, q]   b_k[l], b_v[l]: [S, R, kv]
    a_o[l]:   [S, R, 1, q]   b_o[l]: [S, R, H]
    a_gu[l]:  [S, R, 2, H]   b_g[l], b_u[l]: [S, R, I]
    a_d[l]:   [S, R, 1, I]   b_d[l]: [S, R, H]
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.config import LoraConfig, ModelConfig
from engine.memory import huge_zeros
from engine.lora.layout import PackedLayout, unpack_module
from kernels.cpu import lora as c_lora

# group -> (A buffer, index inside it, B buffer) per module
SLOT_OF_MODULE = {"q_proj": ("a_qkv", 0, "b_q"), "k_proj": ("a_qkv", 1, "b_k"), "v_proj": ("a_qkv", 2, "b_v"),
                  "o_proj": ("a_o", 0, "b_o"), "gate_proj": ("a_gu", 0, "b_g"), "up_proj": ("a_gu", 1, "b_u"),
                  "down_proj": ("a_d", 0, "b_d")}

# fused group -> (A buffer, B buffers in output order, the projections they hold)
GROUPS = {"qkv": ("a_qkv", ("b_q", "b_k", "b_v"), ("q_proj", "k_proj", "v_proj")), "o": ("a_o", ("b_o",), ("o_proj",)),
          "gate_up": ("a_gu", ("b_g", "b_u"), ("gate_proj", "up_proj")), "down": ("a_d", ("b_d",), ("down_proj",))}


class LoraSlots:
    def __init__(self, lora: LoraConfig, m: ModelConfig):
        S, R, L, H, I = lora.max_loras, lora.max_lora_rank, m.num_layers, m.hidden_size, m.intermediate_size
        z = lambda *shape: huge_zeros(L, S, *shape, dtype=m.dtype)   # noqa: E731
        self.paired = c_lora.pairs_b(m.dtype) and c_lora.fits(R, max(H, m.q_size, I))
        zb = (lambda out: z((R + 1) // 2, out, 2)) if self.paired else (lambda out: z(R, out))   # noqa: E731
        self.buf = {"a_qkv": z(R, 3, H), "b_q": zb(m.q_size), "b_k": zb(m.kv_size), "b_v": zb(m.kv_size),
                    "a_o": z(R, 1, m.q_size), "b_o": zb(H), "a_gu": z(R, 2, H), "b_g": zb(I), "b_u": zb(I),
                    "a_d": z(R, 1, I), "b_d": zb(H)}
        self.num_slots = S
        self.dtype = m.dtype
        self.max_rank = R
        self.max_in = max(H, m.q_size, I)      # the widest input a LoRA A reads
        self.slot_of: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}
        self.modules_of: dict[int, frozenset[str]] = {}   # projections the adapter has weights for
        self.lru: OrderedDict[int, None] = OrderedDict()   # adapter ids holding slots, least recent first
        self._c_weights: dict[tuple[int, str], c_lora.Weights] = {}

    def c_weights(self, layer: int, group: str) -> "c_lora.Weights":
        """The C kernel's view of one layer's fused group (built once, then cached)."""
        key = (layer, group)
        w = self._c_weights.get(key)
        if w is None:
            a_name, b_names, _ = GROUPS[group]
            w = self._c_weights[key] = c_lora.Weights(self.buf[a_name][layer], [self.buf[b][layer] for b in b_names],
                                                      self.paired)
        return w

    def b_rows(self, name: str, layer: int, slots: slice | torch.Tensor | int, r: int) -> torch.Tensor:
        """The first r rows of B buffer `name` (Bt, pre-scaled) of some slots: [..., r, out] whatever the layout
        (a view of the plain layout, a copy of the paired one)."""
        b = self.buf[name][layer, slots]
        return c_lora.unpair_rows(b[..., : (r + 1) // 2, :, :])[..., :r, :] if self.paired else b[..., :r, :]

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
            bt = (b * s.scale).T                                                 # [r, out]
            if self.paired:
                self.buf[b_name][layer, slot, : (s.rank + 1) // 2].copy_(c_lora.pair_rows(bt))
            else:
                self.buf[b_name][layer, slot, : s.rank].copy_(bt)
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
