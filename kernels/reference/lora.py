"""The reference multi-LoRA step: for every adapter present, its tokens' rows as one fp32 matmul pair.

Semantics (LoraStep): y[t] += B(a_t)^T-rows @ (A(a_t) @ x[t]) for each token t with an adapter a_t, over
the modules of the group a_t targets; computed in fp32 from the inputs and rounded once into y.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.reference.slots import GROUPS, LoraSlots


class ReferenceLoraStep:
    """Implements kernels.backend.LoraStep over LoraSlots."""

    def __init__(self, slots: LoraSlots, rows_of_slot: dict[int, torch.Tensor]):
        self.slots = slots
        self.rows_of_slot = rows_of_slot                 # slot -> [n] int64 token rows using it
        by_slot = slots.adapter_of_slot()
        self.rank_of_slot = {s: slots.rank_of[by_slot[s]] for s in rows_of_slot}
        self.groups = slots.groups_of(by_slot[s] for s in rows_of_slot)

    @classmethod
    def build(cls, slots: LoraSlots, token_slots: Sequence[int]) -> "ReferenceLoraStep | None":
        rows: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                rows.setdefault(s, []).append(t)
        if not rows:
            return None
        return cls(slots, {s: torch.tensor(r, dtype=torch.long) for s, r in rows.items()})

    def project(self, linear, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        if group in self.groups:
            self.add_deltas(layer, group, x, y)
        return y

    def add_deltas(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of each slot] += that slot's delta of `group`, in place. x: [T, in]; y: [T, out]."""
        a_name, b_names, _ = GROUPS[group]
        for slot, rows in self.rows_of_slot.items():
            r = self.rank_of_slot[slot]
            a = self.slots.buf[a_name][layer, slot, :r]                            # [r, g, in]
            v = x[rows].float() @ a.flatten(0, 1).float().T                        # [n, r * g]
            v = v.view(len(rows), r, len(b_names))
            delta = torch.cat([v[..., i] @ self.slots.b_rows(b, layer, slot, r).float()   # [n, out_i]
                               for i, b in enumerate(b_names)], dim=1)
            y[rows] = (y[rows].float() + delta).to(y.dtype)
