"""Copies a packed adapter into its pages of the pool, overlapped with compute where the device allows.

On a CUDA pool the packed pages come from the host tier's pinned memory and are copied on a side stream,
with one event per adapter: the adapter stays LOADING until its event has completed (`done`), so no step
ever waits on a copy (the scheduler runs only requests whose adapter is resident), and its pages cannot be
evicted or reused while the copy still targets them (AdapterManager evicts RESIDENT adapters only). The
side stream first waits for the work already queued on the compute stream: the pages may have held KV
blocks that a step still in flight reads.
On the host the copy is done at once on the engine thread: the file was already read on the reader
thread, and torch work on a second thread was measured to slow the steps (docs/architecture.md).
"""
from __future__ import annotations

import torch


class PageCopier:
    def __init__(self, storage: torch.Tensor):
        self.storage = storage          # [num_pages, page_elems]
        self.cuda = storage.device.type == "cuda"
        self.stream = torch.cuda.Stream(storage.device) if self.cuda else None
        self.pending: dict[int, tuple[object, torch.Tensor]] = {}   # adapter id -> (event, staged copy)

    def copy(self, adapter_id: int, pages: list[int], packed: torch.Tensor) -> None:
        """packed: [len(pages), page_elems] on the host -> the pages, in order."""
        if not self.cuda:
            self.storage.index_copy_(0, torch.tensor(pages, dtype=torch.long), packed)
            return
        staged = packed if packed.is_pinned() else packed.pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.storage.device))
        with torch.cuda.stream(self.stream):
            index = torch.tensor(pages, dtype=torch.long).to(self.storage.device, non_blocking=True)
            self.storage.index_copy_(0, index, staged.to(self.storage.device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[adapter_id] = (event, staged)     # the staged copy lives until the event completes

    def done(self, adapter_id: int) -> bool:
        """Whether the adapter's copy has landed (no copy pending is done)."""
        entry = self.pending.get(adapter_id)
        if entry is None:
            return True
        if entry[0].query():
            del self.pending[adapter_id]
            return True
        return False

    def wait(self, adapter_id: int) -> None:
        entry = self.pending.pop(adapter_id, None)
        if entry is not None:
            entry[0].synchronize()
