"""Triton paged attention for GPUs: prefill chunks and decode tokens of one step in one launch, K/V read
through each request's block table, query rows taken in tiles so that a tile reads its keys once.

    q:            [R, H, d]   one row per token of the step
    k/v_cache:    [num_pages, block_size, kv_heads, d] views of the page pool (one layer), rows of a page
                  contiguous, both with the same strides
    block_tables: [S, max_blocks] int32 page ids of each request (padded with any valid page)
    tiles:        [N, 4] int32 (request s, first row r0, rows n, length l0): rows r0 .. r0+n-1 belong to
                  request s and row r0+i attends to that request's first l0+i tokens (its own position + 1).
                  Invariant: the tiles cover every row exactly once, 1 <= n <= tile_rows, l0 >= 1.
    window:       > 0: a row of length L attends to its last `window` tokens only, [L - window, L) (a
                  sliding window; keys before the tile's first window are not visited); 0: all.
    softcap:      > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
    -> out [R, H, d]: softmax(scale * q k^T) v over each row's tokens, fp32 inside.

A decode token is a tile of one row; a prefill chunk of n tokens is ceil(n / tile_rows) tiles.
One program per (tile, KV head): its rows are the tile's rows times the G query heads sharing that KV
head, one [M, d] matrix (M >= 16 for tl.dot); keys are visited BLOCK_N at a time, each key's page looked
up in the table (so block_size is free), with an online softmax (running max and sum, base 2).
tl.dot takes the model's dtype: bf16 / fp16 on tensor cores (p rounded to it for p @ v, as flash
attention does), fp32 in full fp32 ("ieee", not TF32). The interpreter has no bf16 tl.dot: under it the
operands are widened to fp32 (WIDEN), the only difference from what a GPU runs. Tested under
TRITON_INTERPRET=1 against the fp32 torch reference.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(q_ptr, o_ptr, k_ptr, v_ptr, table_ptr, tiles_ptr, part_ptr, page_stride, tok_stride,
                            table_stride, scale_log2, rows, window, cap_log2, H: tl.constexpr, G: tl.constexpr,
                            GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                            WIDEN: tl.constexpr, SPLIT_KEYS: tl.constexpr, PARTIALS: tl.constexpr,
                            SLIDING: tl.constexpr, SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tiles_ptr + tile * 4)
    r0 = tl.load(tiles_ptr + tile * 4 + 1)
    n = tl.load(tiles_ptr + tile * 4 + 2)
    l0 = tl.load(tiles_ptr + tile * 4 + 3)
    ms = tl.arange(0, BLOCK_M)
    qi = ms // GP                                   # the row within the tile
    gi = ms % GP                                    # the query head within the KV head's group
    ds = tl.arange(0, DP)
    row_ok = (qi < n) & (gi < G)
    row_len = tl.minimum(l0 + qi, l0 + n - 1)       # rows past the tile repeat its last (stored nowhere)
    base = r0.to(tl.int64) * (H * D) + kvh * G * D
    q = tl.load(q_ptr + base + qi[:, None] * (H * D) + gi[:, None] * D + ds[None, :],
                mask=row_ok[:, None] & (ds[None, :] < D), other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DP), tl.float32)
    if PARTIALS:                                    # this program's keys: [k_lo, k_hi)
        k_lo = split * SPLIT_KEYS
        k_hi = tl.minimum(k_lo + SPLIT_KEYS, l0 + n - 1)
        row_end = tl.minimum(row_len, k_hi)         # each row's last key here, + 1
    else:
        k_lo = 0
        k_hi = l0 + n - 1
        row_end = row_len
    if SLIDING:             # each row's first key; the tile's first row has the smallest
        row_start = row_len - window
        k_lo = tl.maximum(k_lo, (l0 - window) // BLOCK_N * BLOCK_N)
    for start in range(k_lo, k_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < l0 + n - 1
        page = tl.load(table_ptr + seq * table_stride + keys // BS, mask=key_ok, other=0).to(tl.int64)
        key_off = page * page_stride + (keys % BS) * tok_stride + kvh * D                  # [BLOCK_N]
        if DP == D:
            kt = tl.load(k_ptr + key_off[None, :] + ds[:, None], mask=key_ok[None, :], other=0.0)  # [DP, BLOCK_N]
            v = tl.load(v_ptr + key_off[:, None] + ds[None, :], mask=key_ok[:, None], other=0.0)   # [BLOCK_N, DP]
        else:
            kt = tl.load(k_ptr + key_off[None, :] + ds[:, None], mask=key_ok[None, :] & (ds[:, None] < D),
                         other=0.0)
            v = tl.load(v_ptr + key_off[:, None] + ds[None, :], mask=key_ok[:, None] & (ds[None, :] < D),
                        other=0.0)
        if WIDEN:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2                     # [BLOCK_M, BLOCK_N]
        if SOFTCAP:         # cap * tanh(s / cap), in base 2 as s is (cap_log2 = cap * log2 e)
            s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / cap_log2) + 1.0))
        visible = keys[None, :] < row_end[:, None]
        if SLIDING:
            visible = visible & (keys[None, :] >= row_start[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if PARTIALS or SLIDING:     # a row may have no key here yet: p = 0, not NaN (one split, global: key 0 is)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    stored = (qi < n) & (gi < G)
    if PARTIALS:            # this split's max (base 2), sum and unnormalised acc, per (row, head)
        at = ((split * rows + r0 + qi) * H + kvh * G + gi).to(tl.int64)
        tl.store(part_ptr + at * (DP + 2), m_i, mask=stored)
        tl.store(part_ptr + at * (DP + 2) + 1, l_i, mask=stored)
        tl.store(part_ptr + at[:, None] * (DP + 2) + 2 + ds[None, :], acc, mask=stored[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + base + qi[:, None] * (H * D) + gi[:, None] * D + ds[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=stored[:, None] & (ds[None, :] < D))


@triton.jit
def _combine_splits_kernel(o_ptr, tiles_ptr, part_ptr, rows, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                           SPLIT_KEYS: tl.constexpr):
    """out[row, head] from the partials of the splits the row has keys in (ceil(length / SPLIT_KEYS))."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    r0 = tl.load(tiles_ptr + tile * 4 + 1)
    n = tl.load(tiles_ptr + tile * 4 + 2)
    l0 = tl.load(tiles_ptr + tile * 4 + 3)
    ds = tl.arange(0, DP)
    for i in range(0, n):
        splits = (l0 + i + SPLIT_KEYS - 1) // SPLIT_KEYS
        m = tl.full((), float("-inf"), tl.float32)
        for sp in range(0, splits):
            m = tl.maximum(m, tl.load(part_ptr + ((sp * rows + r0 + i) * H + head).to(tl.int64) * (DP + 2)))
        total = tl.zeros((), tl.float32)
        acc = tl.zeros((DP,), tl.float32)
        for sp in range(0, splits):
            at = ((sp * rows + r0 + i) * H + head).to(tl.int64) * (DP + 2)
            w = tl.exp2(tl.load(part_ptr + at) - m)
            total += tl.load(part_ptr + at + 1) * w
            acc += tl.load(part_ptr + at + 2 + ds) * w
        tl.store(o_ptr + ((r0 + i).to(tl.int64) * H + head) * D + ds, (acc / total).to(o_ptr.dtype.element_ty),
                 mask=ds < D)


# NOTE: tile sizes are chosen from ptxas's figures for sm_80 / sm_89 / sm_90 (compile_check), no GPU timing.
TILE_M = 64       # query rows x heads of one program (a prefill tile's rows: TILE_M // group heads)
BLOCK_N = 32      # keys a loop step
NUM_WARPS = 8
NUM_STAGES = 2
# Split-K: a step with few programs (tiles x KV heads) and a long context splits each row's keys into
# SPLIT_KEYS-key ranges, one program each, merged by a second kernel, so that one long decode uses more
# than kv_heads SMs. Not tuned on a GPU: 1,024 keys a split, below 256 programs.
SPLIT_KEYS = 1024
FEW_PROGRAMS = 256


def group_pad(heads: int, kv_heads: int) -> int:
    """Query heads per KV head, padded to a power of two (the M axis of a program holds rows x this)."""
    return triton.next_power_of_2(heads // kv_heads)


def tile_rows(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """How many rows of one request a prefill tile takes (query_tiles' `rows`). fp32 operands take twice
    the registers: at head_dim 128 a 64-row program spills (ptxas, sm_89 / sm_90), so fp32 tiles are
    smaller there (fp32 serves the PEFT-equality tests, not production)."""
    tile_m = 16 if dtype == torch.float32 and head_dim > 64 else TILE_M
    return max(1, tile_m // group_pad(heads, kv_heads))


def num_splits(num_tiles: int, kv_heads: int, max_len: int, split_keys: int = SPLIT_KEYS) -> int:
    """How many key ranges a step's rows are split into (1: none)."""
    if num_tiles * kv_heads >= FEW_PROGRAMS:
        return 1
    return max(1, -(-max_len // split_keys))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    tiles: torch.Tensor, max_rows: int, scale: float, max_len: int = 0,
                    split_keys: int = SPLIT_KEYS, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """See the module docstring for shapes; max_rows: the most rows any tile has (sizes the program);
    max_len: the longest row's length (0: unknown, no split); split_keys: keys a split (num_splits);
    window: the sliding window (0: none); softcap: the scores' soft-cap (0: none)."""
    rows, heads, d = q.shape
    _, bs, kvh, hd = k_cache.shape
    if hd != d or heads % kvh:
        raise ValueError(f"paged_attention: q has {heads} heads of {d}, cache {kvh} KV heads of {hd}")
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride()[1:] == (kvh * d, d, 1), "K/V rows of a page must be contiguous"
    q = q.contiguous()
    out = torch.empty_like(q)
    if tiles.shape[0] == 0:
        return out
    gp = group_pad(heads, kvh)
    block_m = max(16, triton.next_power_of_2(max_rows) * gp)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"      # (tf32 only matters when widened)
    dp = max(16, triton.next_power_of_2(d))
    splits = num_splits(tiles.shape[0], kvh, max_len, split_keys)
    part = torch.empty(splits * rows * heads * (dp + 2) if splits > 1 else 1, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(tiles.shape[0], kvh, splits)](
        q, out, k_cache, v_cache, block_tables, tiles, part, k_cache.stride(0), kvh * d, block_tables.stride(0),
        scale * LOG2E, rows, window, softcap * LOG2E, H=heads, G=heads // kvh, GP=gp, D=d, DP=dp, BS=bs,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, PRECISION=precision, WIDEN=_interpreting(), SPLIT_KEYS=split_keys,
        PARTIALS=splits > 1, SLIDING=window > 0, SOFTCAP=softcap > 0, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if splits > 1:
        _combine_splits_kernel[(tiles.shape[0], heads)](out, tiles, part, rows, H=heads, D=d, DP=dp,
                                                        SPLIT_KEYS=split_keys)
    return out


def _interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
