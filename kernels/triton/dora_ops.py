"""DoRA's row scales as one Triton kernel (Backend.dora_scale): y[t] <- y[t] + y[t] * d_t in place for each
row t with offs[t] >= 0, d_t = pool[offs[t] : offs[t] + N] (the row's adapter's vector of g - 1, which lies
in one page of the pool: kernels/lora_layout.py, with_dora), computed in fp32 and rounded once to y's dtype.
Other rows are not touched. Grid: (T, ceil(N / BLOCK_N))."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 256


@triton.jit
def _dora_scale_kernel(y_ptr, pool_ptr, offs_ptr, n, y_stride, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    off = tl.load(offs_ptr + t)
    if off >= 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        y = tl.load(y_ptr + t * y_stride + cols, mask=mask, other=0.0)
        d = tl.load(pool_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
        v = y.to(tl.float32)
        tl.store(y_ptr + t * y_stride + cols, (v + v * d).to(y.dtype), mask=mask)


def dora_scale_(y: torch.Tensor, storage: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [T, N] rows contiguous; storage the pool [num_pages, page_elems] in y's dtype; offs [T] int64."""
    assert y.stride(1) == 1 and storage.dtype == y.dtype and offs.shape == (y.shape[0],)
    if y.shape[0]:
        _dora_scale_kernel[(y.shape[0], triton.cdiv(y.shape[1], BLOCK_N))](
            y, storage, offs, y.shape[1], y.stride(0), BLOCK=BLOCK_N)
    return y
