"""Triton multi-LoRA kernels that read adapter weights through the page table (S-LoRA unified paging).

Memory model. `pool` is the flat page pool ([num_pages * page_elems], model dtype). Adapter i of the
batch owns pages `page_table[i, :]`; its flat element e lives at
    pool[page_table[i, e // page_elems] * page_elems + e % page_elems].
For one (layer, module), adapter i's A [rank[i], in] starts at flat element a_off[i] and its
B [out, rank[i]] at b_off[i], both row-major (see engine/lora/layout.py). Ranks differ per adapter.

Semantics (adapter index -1 means "no adapter": the token is left alone), for each module g of a fused
group (G modules sharing the input x: q, k, v; gate, up; or one), in one launch:
    shrink:  v[t, g, :rank[g, a_t]]  = x[t] @ A_g(a_t).T                  v: [T, G * max_rank] float32
    expand:  y[t, cols[g]:cols[g+1]] += scale[g, a_t] * v[t, g, :rank[g, a_t]] @ B_g(a_t).T
a_off, b_off, rank, scale are [G, A] (module g's row: its value for each of the batch's adapters; [A] for
G = 1); cols the G + 1 column boundaries of the group's modules in y.
BGMV (`bgmv_*`) takes one adapter index per token (decode). SGMV (`sgmv_*`) takes segments: tokens
seg_start[s] .. seg_start[s+1]-1 all use adapter seg_adapter[s] (prefill), and uses tl.dot on tiles:
in full fp32 ("ieee") for a float32 model, where a GPU would otherwise round the operands to TF32, and
TF32 for bf16 / fp16 weights (which TF32 holds exactly).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_masked(pool_ptr, table_ptr, table_stride, adapter, flat, mask, PAGE: tl.constexpr):
    page = tl.load(table_ptr + adapter * table_stride + flat // PAGE, mask=mask, other=0)
    return tl.load(pool_ptr + page * PAGE + flat % PAGE, mask=mask, other=0.0)


@triton.jit
def _module_cols(g, c0, c1, c2, c3):
    """Module g's first column in y and its width, from the group's column boundaries c0 <= c1 <= c2 <= c3."""
    lo = tl.where(g == 0, c0, tl.where(g == 1, c1, c2))
    hi = tl.where(g == 0, c1, tl.where(g == 1, c2, c3))
    return lo, hi - lo


@triton.jit
def _bgmv_shrink_kernel(x_ptr, v_ptr, pool_ptr, table_ptr, table_stride, a_off_ptr, rank_ptr, idx_ptr,
                        n_in, x_stride, v_stride, mod_stride, v_mod, PAGE: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R                  # this program's rows of A: r0 .. r0 + BLOCK_R - 1
    g = tl.program_id(2)                             # the group's module
    a_off_ptr += g * mod_stride
    rank_ptr += g * mod_stride
    v_ptr += g * v_mod
    a = tl.load(idx_ptr + t)
    r = tl.load(rank_ptr + tl.maximum(a, 0))
    if (a >= 0) & (r0 < r):
        base = tl.load(a_off_ptr + a)
        rows = r0 + tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * x_stride + ks, mask=ks < n_in, other=0.0).to(tl.float32)
            flat = base + rows[:, None] * n_in + ks[None, :]
            m = (rows[:, None] < r) & (ks[None, :] < n_in)
            w = _paged_masked(pool_ptr, table_ptr, table_stride, a, flat, m, PAGE).to(tl.float32)
            acc += tl.sum(w * xk[None, :], axis=1)
        tl.store(v_ptr + t * v_stride + rows, acc, mask=rows < r)


@triton.jit
def _bgmv_expand_kernel(v_ptr, y_ptr, pool_ptr, table_ptr, table_stride, b_off_ptr, rank_ptr, scale_ptr,
                        idx_ptr, c0, c1, c2, c3, v_stride, y_stride, mod_stride, v_mod, PAGE: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    g = tl.program_id(2)                             # the group's module: y columns [y_col, y_col + n_out)
    y_col, n_out = _module_cols(g, c0, c1, c2, c3)
    b_off_ptr += g * mod_stride
    rank_ptr += g * mod_stride
    scale_ptr += g * mod_stride
    v_ptr += g * v_mod
    a = tl.load(idx_ptr + t)
    if a >= 0:
        r = tl.load(rank_ptr + a)
        base = tl.load(b_off_ptr + a)
        scale = tl.load(scale_ptr + a)
        js = tl.arange(0, BLOCK_R)
        ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        vj = tl.load(v_ptr + t * v_stride + js, mask=js < r, other=0.0)
        m = (ns[:, None] < n_out) & (js[None, :] < r)
        w = _paged_masked(pool_ptr, table_ptr, table_stride, a, base + ns[:, None] * r + js[None, :], m,
                          PAGE).to(tl.float32)
        delta = tl.sum(w * vj[None, :], axis=1) * scale
        ptr = y_ptr + t * y_stride + y_col + ns
        old = tl.load(ptr, mask=ns < n_out, other=0.0)
        tl.store(ptr, (old.to(tl.float32) + delta).to(old.dtype), mask=ns < n_out)


@triton.jit
def _sgmv_shrink_kernel(x_ptr, v_ptr, pool_ptr, table_ptr, table_stride, a_off_ptr, rank_ptr, seg_start_ptr,
                        seg_adapter_ptr, n_in, x_stride, v_stride, mod_stride, v_mod, PAGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0)
    mb = tl.program_id(1)
    g = tl.program_id(2)
    a_off_ptr += g * mod_stride
    rank_ptr += g * mod_stride
    v_ptr += g * v_mod
    a = tl.load(seg_adapter_ptr + s)
    start = tl.load(seg_start_ptr + s)
    end = tl.load(seg_start_ptr + s + 1)
    if (a >= 0) & (start + mb * BLOCK_M < end):
        r = tl.load(rank_ptr + a)
        base = tl.load(a_off_ptr + a)
        ms = start + mb * BLOCK_M + tl.arange(0, BLOCK_M)
        js = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ms[:, None] * x_stride + ks[None, :],
                        mask=(ms[:, None] < end) & (ks[None, :] < n_in), other=0.0).to(tl.float32)
            m = (ks[:, None] < n_in) & (js[None, :] < r)
            w_t = _paged_masked(pool_ptr, table_ptr, table_stride, a, base + js[None, :] * n_in + ks[:, None], m,
                                PAGE).to(tl.float32)                   # A^T tile [BLOCK_K, BLOCK_R]
            acc += tl.dot(x, w_t, input_precision=PRECISION)
        tl.store(v_ptr + ms[:, None] * v_stride + js[None, :], acc, mask=(ms[:, None] < end) & (js[None, :] < r))


@triton.jit
def _sgmv_expand_kernel(v_ptr, y_ptr, pool_ptr, table_ptr, table_stride, b_off_ptr, rank_ptr, scale_ptr,
                        seg_start_ptr, seg_adapter_ptr, c0, c1, c2, c3, num_nb, v_stride, y_stride, mod_stride, v_mod,
                        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    s = tl.program_id(0)
    mb = tl.program_id(1)
    g = tl.program_id(2) // num_nb                   # the group's module, and its block of columns
    nb = tl.program_id(2) % num_nb
    y_col, n_out = _module_cols(g, c0, c1, c2, c3)
    b_off_ptr += g * mod_stride
    rank_ptr += g * mod_stride
    scale_ptr += g * mod_stride
    v_ptr += g * v_mod
    a = tl.load(seg_adapter_ptr + s)
    start = tl.load(seg_start_ptr + s)
    end = tl.load(seg_start_ptr + s + 1)
    if (a >= 0) & (start + mb * BLOCK_M < end):
        r = tl.load(rank_ptr + a)
        base = tl.load(b_off_ptr + a)
        scale = tl.load(scale_ptr + a)
        ms = start + mb * BLOCK_M + tl.arange(0, BLOCK_M)
        js = tl.arange(0, BLOCK_R)
        ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        v = tl.load(v_ptr + ms[:, None] * v_stride + js[None, :], mask=(ms[:, None] < end) & (js[None, :] < r),
                    other=0.0)
        m = (js[:, None] < r) & (ns[None, :] < n_out)
        w_t = _paged_masked(pool_ptr, table_ptr, table_stride, a, base + ns[None, :] * r + js[:, None], m,
                            PAGE).to(tl.float32)                       # B^T tile [BLOCK_R, BLOCK_N]
        delta = tl.dot(v, w_t, input_precision=PRECISION) * scale
        ptr = y_ptr + ms[:, None] * y_stride + y_col + ns[None, :]
        mask = (ms[:, None] < end) & (ns[None, :] < n_out)
        old = tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, (old.to(tl.float32) + delta).to(old.dtype), mask=mask)


# NOTE: tile sizes keep each program's weight tile near TILE elements, whatever the rank: with the whole
# rank-64 tile in one program, ptxas gave BGMV shrink 254 registers a thread (8 resident warps per SM) and
# SGMV expand a spill; `python -m bench.triton.compile_check` prints these figures for every launch.
SHRINK_ROWS = 16       # rows of A one BGMV shrink program reduces (the rank is split over programs)
TILE = 1024            # weight elements an expand program holds at once: BLOCK_N = TILE // BLOCK_R, 16..64
BLOCK_K = 64           # columns of x a BGMV shrink program reduces a loop step
SEG_ROWS = 16          # tokens of a segment one SGMV program takes
# WIDE tiles, where Triton's interpreter runs the kernels (TRITON_INTERPRET=1): there a program is one Python
# call per tile operation (numpy inside), whatever the tile's size, so each program takes a whole reduction
# (BLOCK_K: all of `in`), all of the rank's rows, a module's whole width and up to 64 tokens of a segment:
# the same kernels and the same arithmetic per element, in fewer operations (a Triton family test 31 -> 23 s).
# The GPU's tiles above run on a GPU and in the compile check; tests/kernels/triton/test_lora_ops.py runs
# both sets under the interpreter.
WIDE = os.environ.get("TRITON_INTERPRET") == "1"
WIDE_SEG_ROWS = 64


def _block_r(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def _block_n(block_r: int, widest: int) -> int:
    if WIDE:
        return max(16, triton.next_power_of_2(widest))
    return min(64, max(16, TILE // block_r))


def _block_k(n_in: int, block: int) -> int:
    return max(16, triton.next_power_of_2(n_in)) if WIDE else block


def _block_m(block_m: int | None, max_seg_len: int) -> int:
    if block_m is not None:
        return block_m
    return min(WIDE_SEG_ROWS, max(16, triton.next_power_of_2(max_seg_len))) if WIDE else SEG_ROWS


def _precision(weights: torch.Tensor) -> str:
    return "ieee" if weights.dtype == torch.float32 else "tf32"


def _by_module(*tables: torch.Tensor) -> list[torch.Tensor]:
    """[A] -> [1, A]; [G, A] as is. Every table of one launch has the same shape and strides."""
    out = [t if t.dim() == 2 else t.unsqueeze(0) for t in tables]
    assert all(t.shape == out[0].shape and t.stride() == out[0].stride() for t in out), [t.shape for t in out]
    return out


def _boundaries(cols) -> tuple[list[int], int]:
    """The group's G + 1 column boundaries -> four (the last repeated), and the widest module."""
    cols = [int(c) for c in cols]
    assert 2 <= len(cols) <= 4 and cols == sorted(cols), cols
    return cols + [cols[-1]] * (4 - len(cols)), max(b - a for a, b in zip(cols, cols[1:]))


def _v(T: int, width: int, device, zero: bool) -> torch.Tensor:
    """The shrinks' output. Unzeroed, only what the expands read is written: the rows of tokens with an
    adapter, each module's columns below the adapter's rank (one launch a group fewer on a GPU)."""
    return (torch.zeros if zero else torch.empty)(T, width, dtype=torch.float32, device=device)


def bgmv_shrink(x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, a_off: torch.Tensor,
                rank: torch.Tensor, indices: torch.Tensor, max_rank: int, page_elems: int,
                zero: bool = True) -> torch.Tensor:
    """x: [T, in]; a_off, rank: [A] or [G, A]; indices: [T] adapter per token (-1: none) -> v: [T, G * max_rank]
    float32, module g's in columns g * max_rank ... (zero: the rest of v zeros, else unwritten: see _v)"""
    T, n_in = x.shape
    a_off, rank = _by_module(a_off, rank)
    G = a_off.shape[0]
    v = _v(T, G * max_rank, x.device, zero)
    rows = _block_r(max_rank) if WIDE else SHRINK_ROWS
    grid = (T, triton.cdiv(max_rank, rows), G)
    _bgmv_shrink_kernel[grid](x, v, pool, page_table, page_table.stride(0), a_off, rank, indices, n_in,
                              x.stride(0), v.stride(0), a_off.stride(0), max_rank, PAGE=page_elems,
                              BLOCK_R=rows, BLOCK_K=_block_k(n_in, BLOCK_K))
    return v


def bgmv_expand(v: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                b_off: torch.Tensor, rank: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor,
                cols, page_elems: int) -> None:
    """v: [T, G * max_rank] (bgmv_shrink's); b_off, rank, scale: [A] or [G, A]; cols: the G + 1 column
    boundaries of the modules in y: y [T, >= cols[-1]] updated in place in columns [cols[0], cols[-1])."""
    T = v.shape[0]
    b_off, rank, scale = _by_module(b_off, rank, scale)
    G = b_off.shape[0]
    (c0, c1, c2, c3), widest = _boundaries(cols)
    block_r = _block_r(v.shape[1] // G)
    block_n = _block_n(block_r, widest)
    grid = (T, triton.cdiv(widest, block_n), G)
    _bgmv_expand_kernel[grid](v, y, pool, page_table, page_table.stride(0), b_off, rank, scale, indices, c0, c1, c2,
                              c3, v.stride(0), y.stride(0), b_off.stride(0), v.shape[1] // G, PAGE=page_elems,
                              BLOCK_R=block_r, BLOCK_N=block_n)


def sgmv_shrink(x: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor, a_off: torch.Tensor,
                rank: torch.Tensor, seg_start: torch.Tensor, seg_adapter: torch.Tensor, max_rank: int,
                max_seg_len: int, page_elems: int, block_m: int | None = None, zero: bool = True) -> torch.Tensor:
    """x: [T, in]; a_off, rank: [A] or [G, A]; seg_start: [S + 1]; seg_adapter: [S] -> v: [T, G * max_rank]
    float32 (as bgmv_shrink's). block_m: tokens a program (None: SEG_ROWS, or WIDE's)."""
    T, n_in = x.shape
    a_off, rank = _by_module(a_off, rank)
    G = a_off.shape[0]
    v = _v(T, G * max_rank, x.device, zero)
    block_m = _block_m(block_m, max_seg_len)
    grid = (seg_adapter.shape[0], triton.cdiv(max_seg_len, block_m), G)
    block_r = _block_r(max_rank)
    block_k = _block_k(n_in, min(32, max(16, TILE // block_r)))
    _sgmv_shrink_kernel[grid](x, v, pool, page_table, page_table.stride(0), a_off, rank, seg_start, seg_adapter,
                              n_in, x.stride(0), v.stride(0), a_off.stride(0), max_rank, PAGE=page_elems,
                              BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                              PRECISION=_precision(pool))
    return v


def sgmv_expand(v: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, page_table: torch.Tensor,
                b_off: torch.Tensor, rank: torch.Tensor, scale: torch.Tensor, seg_start: torch.Tensor,
                seg_adapter: torch.Tensor, cols, max_seg_len: int, page_elems: int, block_m: int | None = None) -> None:
    """v: [T, G * max_rank]; b_off, rank, scale: [A] or [G, A]; cols as bgmv_expand's; y updated in place."""
    b_off, rank, scale = _by_module(b_off, rank, scale)
    G = b_off.shape[0]
    (c0, c1, c2, c3), widest = _boundaries(cols)
    block_r = _block_r(v.shape[1] // G)
    block_m = _block_m(block_m, max_seg_len)
    block_n = _block_n(block_r, widest) if WIDE else 32 if block_r > 32 else 64
    num_nb = triton.cdiv(widest, block_n)
    grid = (seg_adapter.shape[0], triton.cdiv(max_seg_len, block_m), G * num_nb)
    _sgmv_expand_kernel[grid](v, y, pool, page_table, page_table.stride(0), b_off, rank, scale, seg_start,
                              seg_adapter, c0, c1, c2, c3, num_nb, v.stride(0), y.stride(0), b_off.stride(0),
                              v.shape[1] // G, PAGE=page_elems, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
                              PRECISION=_precision(pool))
