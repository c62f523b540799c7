"""Which backends run on this machine, and small shapes for testing them."""
from __future__ import annotations

import dataclasses
import os

import torch

from kernels.cpu.backend import CpuBackend
from kernels.reference.backend import TorchBackend
from kernels.selector import select_backend
from kernels.triton.backend import TritonBackend
from tests.engine.lora.synthetic import TINY

# head_dim 32: the CPU backend's paired KV layout applies (bf16 on AVX512-BF16)
SHAPE = dataclasses.replace(TINY, hidden_size=128, intermediate_size=192, num_heads=4, num_kv_heads=2, head_dim=32)
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# `make gpu-check` runs these tests on CUDA (LORAPLEX_TEST_DEVICE=cuda, without the Triton interpreter)
DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))


BACKEND_CLASSES = {"torch": TorchBackend, "cpu": CpuBackend, "triton": TritonBackend}


def available_backends() -> list[str]:
    """Every backend that runs here: the reference always, the CPU one where its C kernels build, Triton
    where it has a GPU or the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
    names = ["torch"]
    if DEVICE.type == "cpu" and CpuBackend.available():
        names.append("cpu")
    if TritonBackend.runs_on(DEVICE):
        names.append("triton")
    return names


def backend(name: str, dtype: torch.dtype, **shape):
    return select_backend(name, dataclasses.replace(SHAPE, dtype=dtype, **shape), DEVICE)


def on_device(fn, *args):
    """fn(*args) with every tensor argument on DEVICE -> (its result, its arguments), both on the host, so a
    kernel test built on CPU tensors runs on the GPU under `make gpu-check` (args show in-place updates)."""
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*moved)
    return (out.cpu() if isinstance(out, torch.Tensor) else out), [
        a.cpu() if isinstance(a, torch.Tensor) else a for a in moved]
