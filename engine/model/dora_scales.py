"""A step's DoRA rescaling: each DoRA row's fused projection outputs times g = 1 + d (engine/lora/dora.py).

The backends compute every row's W x + s B A x as for any LoRA adapter; then, before a bias, the rows of a
DoRA adapter become y + y * d, rounded once (`Backend.dora_scale`: a C loop on the CPU, a Triton kernel on a
GPU), d read where it rests in the adapter's pages (each vector lies inside one page: with_dora). Rows of other
adapters, or of none, are not touched, so a row's result never depends on its batch. One call per (layer,
group) that some adapter of the step rescales, whatever the number of adapters.

Shapes: y [T, out of the group], the step's T token rows; `offs` [K, T] int64: for each (layer, group) any
DoRA adapter of the step adapts, each row's element offset of its d vector in the pool's flat storage, -1 for
rows it leaves alone.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.backend import Backend
from kernels.lora_layout import PackedLayout


class DoraScales:
    def __init__(self, ops: Backend, storage: torch.Tensor, offs: torch.Tensor, index: dict[tuple[int, str], int]):
        self.ops = ops
        self.storage = storage
        self.offs = offs            # [K, T]
        self.index = index          # (layer, group) -> its row of offs

    @classmethod
    def build(cls, ops: Backend, storage: torch.Tensor, token_adapters: Sequence[int],
              placement: Callable[[int], tuple[PackedLayout, Sequence[int]]]) -> "DoraScales | None":
        """token_adapters: each token row's adapter id (0: none); placement(id) -> its layout and pages. None
        when no row has a DoRA adapter."""
        pe = storage.shape[1]
        adapters: dict[int, dict[tuple[int, str], int]] = {}
        for aid in dict.fromkeys(token_adapters):
            if aid:
                layout, pages = placement(aid)
                if layout.dora:
                    adapters[aid] = {key: pages[first // pe] * pe + first % pe
                                     for key, (first, _) in layout.dora.items()}
        if not adapters:
            return None
        index = {key: i for i, key in enumerate(sorted(set().union(*adapters.values())))}
        per_adapter = torch.full((len(adapters) + 1, len(index)), -1, dtype=torch.int64)   # row 0: none
        for j, offs in enumerate(adapters.values(), 1):
            per_adapter[j, [index[k] for k in offs]] = torch.tensor(list(offs.values()), dtype=torch.int64)
        row = {aid: j for j, aid in enumerate(adapters, 1)}
        which = torch.tensor([row.get(a, 0) for a in token_adapters], dtype=torch.int64)
        offs = per_adapter[which].T.contiguous()
        return cls(ops, storage, offs if storage.device.type == "cpu" else offs.to(storage.device), index)

    def apply(self, layer: int, group: str, y: torch.Tensor) -> torch.Tensor:
        """y [T, out]: every DoRA row's output of `group` at `layer` times 1 + d -> the result (y, updated)."""
        i = self.index.get((layer, group))
        return y if i is None else self.ops.dora_scale(y, self.storage, self.offs[i])
