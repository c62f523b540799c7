"""Triton paged attention for GPUs: every query row attends to its own prefix, K/V read through the block table.

Same contract as the C kernel (kernels/cpu/attention.py), so decode and prefill take one path:
    q:            [R, H, d]    one row per token (decode: one per request; prefill: every new token)
    k/v_cache:    [num_pages, block_size, kv_heads, d] views of the page pool (one layer), rows of a page
                  contiguous, both with the same strides
    block_tables: [R, max_blocks] int64 page ids of each row's request (padded with any valid page)
    lens:         [R] int64 how many tokens row r attends to (>= 1; its own position + 1 in a prefill)
    -> out [R, H, d]: softmax(scale * q k^T) v over tokens [0, lens[r]) of row r, fp32 inside.
One program per (row, KV head): the query heads sharing that KV head are its G rows; blocks are visited
once with an online softmax (running max and sum), so K/V are read once per row and head group.
head_dim and block_size must be powers of two (Triton block shapes). Tested under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(q_ptr, o_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, page_stride, tok_stride,
                            table_stride, scale, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                            D: tl.constexpr, BS: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.load(lens_ptr + row)
    gs = tl.arange(0, GP)
    ds = tl.arange(0, D)
    ts = tl.arange(0, BS)
    heads = kvh * G + gs
    q_off = row * H * D + heads[:, None] * D + ds[None, :]
    q = tl.load(q_ptr + q_off, mask=gs[:, None] < G, other=0.0).to(tl.float32)          # [GP, D]
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for start in range(0, n, BS):
        page = tl.load(table_ptr + row * table_stride + start // BS)
        valid = start + ts < n
        kv_off = page * page_stride + ts[:, None] * tok_stride + kvh * D + ds[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)      # [BS, D]
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                         # [GP, BS]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=gs[:, None] < G)


# NOTE: 8 warps, not Triton's default 4: the [G, BS, D] products take ~190-210 registers a thread with 4
# (8 resident warps per SM on sm_80 / sm_90), ~128 with 8 (16 warps per SM); ptxas's figures, no GPU timing.
NUM_WARPS = 8


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:
    """See the module docstring for shapes."""
    rows, heads, d = q.shape
    _, bs, kvh, hd = k_cache.shape
    if hd != d or heads % kvh:
        raise ValueError(f"paged_attention: q has {heads} heads of {d}, cache {kvh} KV heads of {hd}")
    if not (_pow2(d) and _pow2(bs)):
        raise ValueError(f"paged_attention: head_dim ({d}) and block_size ({bs}) must be powers of two")
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride()[1:] == (kvh * d, d, 1), "K/V rows of a page must be contiguous"
    q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    g = heads // kvh
    _paged_attention_kernel[(rows, kvh)](q, out, k_cache, v_cache, block_tables, lens, k_cache.stride(0),
                                         kvh * d, block_tables.stride(0), scale, H=heads, G=g,
                                         GP=max(triton.next_power_of_2(g), 2), D=d, BS=bs, num_warps=NUM_WARPS)
    return out
