"""The host tier: adapters already packed as their pages ([num_pages, page_elems], the model dtype, or
Int8Pages with `--host-tier-dtype int8`), in host memory, least recently used first. A load from it is one
copy into the pool, with no file read (an int8 copy is dequantized on the loader's thread); when the pool
is on a GPU the loader packed them pinned, so that copy runs on the side stream with no staging copy.
Bounded by a count and by bytes (always keeping the newest entry)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.lora.int8_pages import Int8Pages


class HostTier(OrderedDict):
    """adapter id -> its packed pages, least recently used first."""

    def __init__(self, max_adapters: int, max_bytes: int):
        super().__init__()
        self.max_adapters, self.max_bytes = max_adapters, max_bytes

    def put(self, adapter_id: int, packed: torch.Tensor | Int8Pages) -> None:
        """Keep `packed` as the most recent entry; drop the least recent ones beyond the bounds. An entry
        dropped while its copy is in flight stays alive in the copier (or the loader) until the copy lands."""
        self[adapter_id] = packed
        self.move_to_end(adapter_id)
        while len(self) > self.max_adapters or (len(self) > 1 and self.nbytes > self.max_bytes):
            self.popitem(last=False)

    def use(self, adapter_id: int) -> torch.Tensor | Int8Pages | None:
        """The packed pages (now the most recent entry), or None if not held."""
        packed = self.get(adapter_id)
        if packed is not None:
            self.move_to_end(adapter_id)
        return packed

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.values())
