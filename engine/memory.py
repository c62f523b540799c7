"""Large, long-lived host buffers backed by transparent huge pages.

Streaming hundreds of MB of weights per step through 4 KiB pages costs TLB misses; buffers read every
step (the page pool, LoRA compute slots) are mapped with MADV_HUGEPAGE where the kernel allows it.
"""
from __future__ import annotations

import mmap

import torch


def huge_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(*shape, dtype=dtype), backed by an anonymous mapping advised for huge pages."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = max(1, numel * dtype.itemsize)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    # NOTE: the tensor keeps `buf` alive through the buffer protocol; anonymous pages start zeroed.
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(*shape)
