"""The host tier: adapters already packed as their pages ([num_pages, page_elems], the model dtype), in host
memory, least recently used first. A load from it is one copy into the pool (engine/lora/page_copier.py);
when the pool is on a GPU the packed pages are pinned, so that copy runs on the side stream with no
staging copy. Bounded by a count and by bytes (always keeping the newest entry)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.lora.host_adapter import HostAdapter
from engine.lora.layout import PackedLayout, pack


class HostTier(OrderedDict):
    """adapter id -> its packed pages, least recently used first."""

    def __init__(self, max_adapters: int, max_bytes: int, pinned: bool):
        super().__init__()
        self.max_adapters, self.max_bytes, self.pinned = max_adapters, max_bytes, pinned

    def pack(self, host: HostAdapter, layout: PackedLayout, page_elems: int) -> torch.Tensor:
        """The adapter as its pages, pinned when they will be copied to a GPU."""
        packed = pack(host, layout, page_elems)
        return packed.pin_memory() if self.pinned else packed

    def put(self, adapter_id: int, packed: torch.Tensor) -> None:
        """Keep `packed` as the most recent entry; drop the least recent ones beyond the bounds. An entry
        dropped while its copy is in flight stays alive in the copier until the copy lands."""
        self[adapter_id] = packed
        self.move_to_end(adapter_id)
        while len(self) > self.max_adapters or (len(self) > 1 and self.nbytes > self.max_bytes):
            self.popitem(last=False)

    def use(self, adapter_id: int) -> torch.Tensor | None:
        """The packed pages (now the most recent entry), or None if not held."""
        packed = self.get(adapter_id)
        if packed is not None:
            self.move_to_end(adapter_id)
        return packed

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.values())
