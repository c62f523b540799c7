"""ctypes bindings of the C multi-LoRA kernels (lora.c) and of what the bf16 GEMM needs to compute
decode tokens' LoRA itself (gemm_lora_avx512bf16.c).

A `LoraDecode` (decode tokens), `LoraSegments` (prefill tokens grouped by adapter; on AMX every token) or
`LoraRows` (decode tokens, for the GEMM) is prepared once per step and then used for every layer and fused group; weight
pointers are cached per buffer view (`Weights`), so a call costs a few microseconds of Python.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu import gemm as c_gemm
from kernels.cpu.build import has_avx2_fma, has_avx512_bf16, load_functions

_FNS: dict | None | bool = False   # False until first use
_SEG: dict | None | bool = False


def _fns():
    global _FNS
    if _FNS is False:
        _FNS = load_functions("lora", {torch.bfloat16: "lora_decode_bf16", torch.float32: "lora_decode_f32"})
    return _FNS


def _segment_fns():
    global _SEG
    if _SEG is False:
        _SEG = (load_functions("lora", {torch.bfloat16: "lora_segments_bf16"})
                if has_avx512_bf16() or has_avx2_fma() else None)
    return _SEG


MAX_RANK, MAX_IN = 256, 65536   # as compiled into lora.c (at most 3 fused outputs)


def fits(max_rank: int, max_in: int) -> bool:
    return max_rank <= MAX_RANK and max_in <= MAX_IN


def supports(dtype: torch.dtype) -> bool:
    fns = _fns()
    return fns is not None and dtype in fns


def pairs_b(dtype: torch.dtype) -> bool:
    """Whether this dtype's C kernels read B in the paired layout of lora_avx512bf16.h ([S, ceil(R / 2), out, 2]:
    two ranks of 16 columns per 64-byte line, vdpbf16ps's operand): bf16 on a CPU with AVX512-BF16."""
    return dtype == torch.bfloat16 and has_avx512_bf16() and supports(dtype)


def pair_rows(b: torch.Tensor) -> torch.Tensor:
    """Bt [..., R, out] -> the paired layout [..., ceil(R / 2), out, 2] (a zero rank appended to an odd R)."""
    r = b.shape[-2]
    if r % 2:
        b = torch.cat([b, b.new_zeros(*b.shape[:-2], 1, b.shape[-1])], dim=-2)
    return b.unflatten(-2, (-1, 2)).transpose(-1, -2)


def unpair_rows(b: torch.Tensor) -> torch.Tensor:
    """The paired layout [..., P, out, 2] -> Bt [..., 2P, out] (a copy)."""
    return b.transpose(-1, -2).flatten(-3, -2)


def supports_fused(dtype: torch.dtype) -> bool:
    """Whether the C base GEMM computes decode tokens' LoRA itself here (LoraRows; bf16, AVX512-BF16; on AVX2 the
    decode kernel runs after the GEMM instead: measured faster there)."""
    return dtype == torch.bfloat16 and c_gemm.supports_lora()


def supports_segments(dtype: torch.dtype) -> bool:
    """Whether LoraSegments runs here (bf16 on a CPU with AVX512-BF16 or AVX2 + FMA)."""
    fns = _segment_fns()
    return fns is not None and dtype in fns


def segments_on_amx(dtype: torch.dtype) -> bool:
    """Whether the segment kernel runs on AMX tiles here (lora_amx.h; bf16, AMX granted and switched on:
    c_gemm.amx()). Then every token with an adapter goes there, decode tokens grouped by adapter too: a
    token's bits are then the same whatever path its prompt's chunks took."""
    fns = _amx_switch()
    return supports_segments(dtype) and fns is not None and bool(fns["amx"](-1))


@functools.cache
def _amx_switch():
    return load_functions("lora", {"amx": "gemm_amx"}) if has_avx512_bf16() else None


class GroupShape:
    """What a fused group's tables share whatever the step: its input width and output widths."""

    def __init__(self, n_in: int, outs: list[int]):
        self.n_in, self.groups, self.width = n_in, len(outs), sum(outs)
        self.outs = (ctypes.c_int64 * len(outs))(*outs)
        self.fusable = all(o % 16 == 0 for o in outs)   # the GEMM epilogue works on 16 columns


class Weights:
    """One layer's fused group for the step's adapters ("slots" 0..S-1), as the C kernels take it: pointer
    tables a[s] -> slot s's A [R_s, G, in] (rows contiguous, rank-major) and b[s * G + g] -> its Bt of
    output g, [R_s, out_g] (rows contiguous) or, with `paired` (see pairs_b), [ceil(R_s / 2), out_g, 2];
    R = max R_s, the most rank rows a token may read. The memory behind the pointers (the pool's pages,
    or the tensors given to `of`) must outlive the step; `keep` holds what the tables were made from."""

    def __init__(self, a: int, b: int, max_rank: int, shape: "GroupShape", paired: bool, dtype: torch.dtype,
                 keep: object = None):
        """a, b: addresses of the int64 pointer tables ([S] and [S * G]); shape: the group's (built once)."""
        self.a, self.b, self.keep = a, b, keep
        self.paired, self.dtype = paired, dtype
        self.max_rank, self.groups, self.n_in = max_rank, shape.groups, shape.n_in
        self.width, self.outs, self.fusable = shape.width, shape.outs, shape.fusable

    @classmethod
    def of(cls, a: torch.Tensor, bs: list[torch.Tensor], paired: bool | None = None) -> "Weights":
        """From dense per-slot tensors (tests and tools): a [S, R, G, in], bs[g] [S, R, out_g] plain (paired
        here, a copy, where this dtype's kernels want it) or, with paired=True, [S, ceil(R / 2), out_g, 2]."""
        S, R, G, n_in = a.shape
        assert a.stride()[1:] == (G * n_in, n_in, 1) and len(bs) == G
        if paired is None:
            paired = pairs_b(a.dtype)
            if paired:
                bs = [pair_rows(b).contiguous() for b in bs]
        for b in bs:
            assert b.dtype == a.dtype and b[0].is_contiguous()
        a_ptrs = torch.tensor([a[s].data_ptr() for s in range(S)], dtype=torch.int64)
        b_ptrs = torch.tensor([bs[g][s].data_ptr() for s in range(S) for g in range(G)], dtype=torch.int64)
        return cls(a_ptrs.data_ptr(), b_ptrs.data_ptr(), R, GroupShape(n_in, [b.shape[2] for b in bs]), paired,
                   a.dtype, keep=(a, bs, a_ptrs, b_ptrs))


def _launch(fn, name: str, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor, w: Weights,
            index: list[torch.Tensor], n: int) -> None:
    """Call a kernel of lora.c: x, y, then the token index arrays, n, then the weights' layout.
    x: [T, in]; y: [T, sum(out_g)]; rows of both contiguous."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and x.shape[1] == w.n_in and y.shape[1] == w.width
    assert x.dtype == y.dtype == w.dtype == dtype and w.paired == pairs_b(dtype)
    rc = fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), *[t.data_ptr() for t in index], n,
            w.a, w.max_rank, w.groups, w.n_in, w.b, w.outs)
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc} (max rank {w.max_rank}, groups {w.groups}, in {w.n_in})")


class LoraDecode:
    """y[t, cols of output g] += Bt_g(s)[:r]^T @ (A(s)[:r, g] @ x[t]) for (t, s, r) in zip(tokens, slots,
    ranks), in place (A(s), Bt_g(s): slot s's entries of the Weights' tables). tokens, slots, ranks: [n]
    (tokens distinct, ranks <= R). Requires supports(dtype)."""

    def __init__(self, tokens: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, dtype: torch.dtype):
        self.tokens, self.slots, self.ranks = (t.to(torch.int64).contiguous() for t in (tokens, slots, ranks))
        assert self.tokens.shape == self.slots.shape == self.ranks.shape
        self.n = len(self.tokens)
        self.fn = _fns()[dtype]
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: Weights) -> None:
        _launch(self.fn, "lora_decode", self.dtype, x, y, w, [self.tokens, self.slots, self.ranks], self.n)


class LoraSegments:
    """Prefill tokens grouped by adapter: segment i is tokens[starts[i]:starts[i + 1]], all with slot
    slots[i] and rank ranks[i]; y[t] += Bt_g(s)[:r]^T @ (A(s)[:r, g] @ x[t]) for each, in place, every
    token computed on its own. Requires supports_segments(dtype)."""

    def __init__(self, tokens: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor,
                 dtype: torch.dtype):
        self.tokens, self.starts, self.slots, self.ranks = (
            t.to(torch.int64).contiguous() for t in (tokens, starts, slots, ranks))
        assert len(self.starts) == len(self.slots) + 1 == len(self.ranks) + 1
        assert int(self.starts[0]) == 0 and int(self.starts[-1]) == len(self.tokens)
        self.n = len(self.slots)
        self.fn = _segment_fns()[dtype]
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: Weights) -> None:
        _launch(self.fn, "lora_segments", self.dtype, x, y, w, [self.tokens, self.starts, self.slots, self.ranks],
                self.n)


class LoraRows:
    """Decode tokens whose whole LoRA the C base GEMM computes (c_gemm.GemmLora, gemm_lora_*.c): (t, s, r)
    for t, s, r in zip(tokens, slots, ranks), tokens distinct rows of a step of num_rows tokens.
    Requires supports_fused(dtype)."""

    def __init__(self, tokens: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, num_rows: int):
        tokens = tokens.to(torch.int64)
        self.row_slot = torch.full((num_rows,), -1, dtype=torch.int64)
        self.row_slot[tokens] = slots.to(torch.int64)
        self.row_rank = torch.zeros(num_rows, dtype=torch.int64)
        self.row_rank[tokens] = ranks.to(torch.int64)

    def __call__(self, w: Weights) -> c_gemm.GemmLora:
        assert w.fusable
        return c_gemm.GemmLora(self.row_slot, self.row_rank, w.a, w.max_rank, w.groups, w.n_in, w.b, w.outs,
                               w.paired, w)
