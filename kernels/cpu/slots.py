"""The CPU backend's adapter slots: kernels/reference/slots.py's layout, with B paired two ranks per
64-byte line where the bf16 C kernels read it so (kernels/cpu/lora_bf16.h: each B [S, ceil(R / 2), out, 2]),
and each (layer, group)'s C view (`c_weights`) built once."""
from __future__ import annotations

import torch

from kernels.cpu import lora as c_lora
from kernels.memory import huge_zeros
from kernels.reference.slots import GROUPS, LoraSlots


class CpuLoraSlots(LoraSlots):
    def __init__(self, num_slots: int, max_rank: int, shape, storage: torch.Tensor):
        self.paired = c_lora.pairs_b(shape.dtype) and c_lora.fits(
            max_rank, max(shape.hidden_size, shape.q_size, shape.intermediate_size))
        super().__init__(num_slots, max_rank, shape, storage)
        self._c_weights: dict[tuple[int, str], c_lora.Weights] = {}

    def _b_buffer(self, layers: int, slots: int, rank: int, out: int) -> torch.Tensor:
        if self.paired:
            return huge_zeros(layers, slots, (rank + 1) // 2, out, 2, dtype=self.dtype)
        return super()._b_buffer(layers, slots, rank, out)

    def _store_b(self, name: str, layer: int, slot: int, bt: torch.Tensor) -> None:
        if self.paired:
            self.buf[name][layer, slot, : (bt.shape[0] + 1) // 2].copy_(c_lora.pair_rows(bt))
        else:
            super()._store_b(name, layer, slot, bt)

    def b_rows(self, name: str, layer: int, slots: slice | torch.Tensor | int, r: int) -> torch.Tensor:
        """[..., r, out] whatever the layout (a view of the plain layout, a copy of the paired one)."""
        if not self.paired:
            return super().b_rows(name, layer, slots, r)
        b = self.buf[name][layer, slots]
        return c_lora.unpair_rows(b[..., : (r + 1) // 2, :, :])[..., :r, :]

    def c_weights(self, layer: int, group: str) -> c_lora.Weights:
        """The C kernel's view of one layer's fused group (built once, then cached)."""
        key = (layer, group)
        w = self._c_weights.get(key)
        if w is None:
            a_name, b_names, _ = GROUPS[group]
            w = self._c_weights[key] = c_lora.Weights(self.buf[a_name][layer], [self.buf[b][layer] for b in b_names],
                                                      self.paired)
        return w
