"""ctypes binding of the C paged decode attention (paged_decode_attention.c).

`supports(dtype)` is False when the library cannot be built here (no compiler) or is disabled with
LORAPLEX_CPU_KERNELS=0; callers then use the torch path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu.build import load_functions

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGS = [_P, _P, _P, _P, _I64, _P, _I64, _P, _I, _I, _I, _I, _I, _F]
_FNS: dict | None | bool = False   # False until first use


def _fns():
    global _FNS
    if _FNS is False:
        _FNS = load_functions("paged_decode_attention", {torch.bfloat16: "paged_decode_attention_bf16",
                                                         torch.float32: "paged_decode_attention_f32"}, _ARGS)
    return _FNS


MAX_HEADS, MAX_HEAD_DIM = 128, 256   # as compiled into paged_decode_attention.c


def fits(num_heads: int, head_dim: int) -> bool:
    """Whether a model's attention shape is within what the kernel was compiled for."""
    return num_heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM


def supports(dtype: torch.dtype) -> bool:
    fns = _fns()
    return fns is not None and dtype in fns


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [D, H, d]; k_cache, v_cache: [num_pages, block_size, kv_heads, d] views sharing one page stride
    (rows inside a page contiguous); block_tables: [D, max_blocks] int64; lens: [D] int64 (each >= 1 and
    <= max_blocks * block_size) -> out [D, H, d]. Requires supports(q.dtype)."""
    d_, h, d = q.shape
    _, bs, kvh, hd = k_cache.shape
    page_stride = k_cache.stride(0)
    assert hd == d and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride()[1:] == (kvh * d, d, 1), "K/V rows of a page must be contiguous"
    assert q.dtype == k_cache.dtype == v_cache.dtype
    q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    assert block_tables.shape[0] == lens.shape[0] == d_
    out = torch.empty_like(q)
    rc = _fns()[q.dtype](q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), page_stride,
                         block_tables.data_ptr(), block_tables.shape[1], lens.data_ptr(), d_, h, kvh, d, bs, scale)
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed with code {rc} (heads {h}, kv heads {kvh}, dim {d})")
    return out
