"""Picks the compute backend: `select_backend(name, shape, device)`.

"auto": on CUDA the Triton backend; on CPU the CPU backend where its C kernels build, else the
reference torch backend. "torch", "cpu" and "triton" force one (ValueError where it cannot run).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # NOTE: torch is imported only when a backend is selected (the CLI imports BACKENDS)
    import torch

    from kernels.backend import Backend, ModelShape

BACKENDS = ("auto", "torch", "cpu", "triton")
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is CUDA when torch sees one, else the CPU."""
    import torch
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).split(":")[0] not in DEVICES:
        raise ValueError(f"device: {device!r} is not one of {', '.join(DEVICES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device here")
    return dev


def configure_cpu_kernels(cache_dir: str | None = None, enabled: bool | None = None) -> None:
    """Where the C kernels are built and cached, and whether they are used (see kernels/cpu/build.py)."""
    from kernels.cpu import build
    build.configure(cache_dir, enabled)


def check_dtype_runs_on(device: torch.device, dtype: torch.dtype) -> None:
    """bfloat16 needs a GPU of compute capability 8.0 or more (Ampere): Triton's bf16 `tl.dot` and torch's
    bf16 GEMMs do not run below. ValueError naming the GPU and what to do instead."""
    import torch
    if dtype != torch.bfloat16:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        raise ValueError(f"dtype: bfloat16 needs a GPU of compute capability 8.0 or more; "
                         f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use --dtype float32")


def select_backend(name: str, shape: ModelShape, device: str | torch.device = "cpu", block_size: int = 16) -> Backend:
    """The backend called `name` (one of BACKENDS) for this model shape on `device`, with KV blocks of
    `block_size` tokens (the engine's --block-size)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: {name!r} is not one of {', '.join(BACKENDS)}")
    dev = resolve_device(device)
    if dev.type == "cuda":
        check_dtype_runs_on(dev, shape.dtype)
    if name == "auto":
        name = "triton" if dev.type == "cuda" else "cpu"
        if name == "cpu":
            from kernels.cpu.backend import CpuBackend
            if not CpuBackend.available():
                name = "torch"
    if name == "torch":
        from kernels.reference.backend import TorchBackend
        return TorchBackend(shape, dev, block_size)
    if name == "cpu":
        if dev.type != "cpu":
            raise ValueError(f"backend 'cpu' runs on the CPU, not on {dev}")
        from kernels.cpu.backend import CpuBackend
        return CpuBackend(shape, dev, block_size)
    from kernels.triton.backend import TritonBackend
    return TritonBackend(shape, dev, block_size)
