"""A step's small host tensors to the device in one copy.

Each `tensor.to("cuda")` of a step's metadata (token ids, positions, block tables, tiles, LoRA indices) is
a separate transfer with its own fixed cost, from pageable memory. `to_device` packs them into one int64
buffer in pinned memory (torch's caching host allocator, which keeps a block until the copies reading it
are done), copies it with one non-blocking transfer, and returns views of the device copy with the
original shapes and dtypes (integer and bool tensors only: what step metadata is).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensors: Sequence[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """The same tensors on `device` (None stays None); on the CPU, the tensors themselves."""
    if device.type == "cpu" or all(t is None for t in tensors):
        return list(tensors)
    return unpack(pack(tensors).pin_memory().to(device, non_blocking=True), tensors)


def pack(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Every tensor's values, flattened in order, as one int64 vector (on the host)."""
    present = [t for t in tensors if t is not None]
    for t in present:
        assert not t.is_floating_point() and not t.is_complex(), f"to_device: {t.dtype} is not an index type"
    return torch.cat([t.reshape(-1).to(torch.int64) for t in present])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """pack's inverse: views of `flat` (wherever it is) with the shapes and dtypes of `like`."""
    out, at = [], 0
    for t in like:
        if t is None:
            out.append(None)
            continue
        part = flat[at:at + t.numel()].view(t.shape)
        out.append(part if t.dtype == torch.int64 else part.to(t.dtype))
        at += t.numel()
    return out
