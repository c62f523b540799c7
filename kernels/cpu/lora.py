"""ctypes bindings of the C multi-LoRA kernels (lora_decode.c) and of what the bf16 GEMM needs to compute
decode tokens' LoRA itself (gemm_lora.c).

A `LoraDecode` (decode tokens), `LoraSegments` (prefill tokens grouped by adapter) or `LoraRows` (decode
tokens, for the GEMM) is prepared once per step and then used for every layer and fused group; weight
pointers are cached per buffer view (`Weights`), so a call costs a few microseconds of Python.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import gemm as c_gemm
from kernels.cpu.build import has_avx2_fma, has_avx512_bf16, load_functions

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = [_P, _I64, _P, _I64, _P, _P, _P, _I, _P, _I64, _I, _I, _I, _P, _P, _P]
_FNS: dict | None | bool = False   # False until first use
_SEG: dict | None | bool = False


def _fns():
    global _FNS
    if _FNS is False:
        _FNS = load_functions("lora_decode", {torch.bfloat16: "lora_decode_bf16", torch.float32: "lora_decode_f32"},
                              _ARGS)
    return _FNS


def _segment_fns():
    global _SEG
    if _SEG is False:
        _SEG = (load_functions("lora_decode", {torch.bfloat16: "lora_segments_bf16"}, [*_ARGS[:4], _P, *_ARGS[4:]])
                if has_avx512_bf16() or has_avx2_fma() else None)
    return _SEG


MAX_RANK, MAX_IN = 256, 65536   # as compiled into lora_decode.c (at most 3 fused outputs)


def fits(max_rank: int, max_in: int) -> bool:
    return max_rank <= MAX_RANK and max_in <= MAX_IN


def supports(dtype: torch.dtype) -> bool:
    fns = _fns()
    return fns is not None and dtype in fns


def pairs_b(dtype: torch.dtype) -> bool:
    """Whether this dtype's C kernels read B in the paired layout of lora_bf16.h ([S, ceil(R / 2), out, 2]:
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
    """Whether the C base GEMM computes decode tokens' LoRA itself here (LoraRows; bf16, AVX512-BF16)."""
    return dtype == torch.bfloat16 and c_gemm.supports_lora()


def supports_segments(dtype: torch.dtype) -> bool:
    """Whether LoraSegments runs here (bf16 on a CPU with AVX512-BF16 or AVX2 + FMA)."""
    fns = _segment_fns()
    return fns is not None and dtype in fns


class Weights:
    """One layer's fused group in the slot layout: a [S, R, G, in] (rows of a slot contiguous) and
    bs[g] [S, R, out_g] (rows contiguous), or with `paired` (see pairs_b) [S, ceil(R / 2), out_g, 2]
    (contiguous per slot); checked once and turned into the kernel's pointer arrays."""

    def __init__(self, a: torch.Tensor, bs: list[torch.Tensor], paired: bool = False):
        S, R, G, n_in = a.shape
        assert len(bs) == G and a.stride()[1:] == (G * n_in, n_in, 1)
        if paired:
            P = (R + 1) // 2
            assert all(b.shape[:2] == (S, P) and b.shape[3] == 2 and b.stride()[1:] == (2 * b.shape[2], 2, 1)
                       for b in bs)
        else:
            assert all(b.shape[:2] == (S, R) and b.stride()[1:] == (b.shape[2], 1) for b in bs)
        assert all(b.dtype == a.dtype for b in bs)
        self.paired = paired
        self.a, self.bs = a, bs                      # keep the views (and their storage) alive
        self.max_rank, self.groups, self.n_in = R, G, n_in
        self.width = sum(b.shape[2] for b in bs)
        self.b_ptrs = (ctypes.c_void_p * G)(*[b.data_ptr() for b in bs])
        self.b_strides = (ctypes.c_int64 * G)(*[b.stride(0) for b in bs])
        self.outs = (ctypes.c_int64 * G)(*[b.shape[2] for b in bs])
        self.fusable = all(b.shape[2] % 16 == 0 for b in bs)   # the GEMM epilogue works on 16 columns

    @classmethod
    def of(cls, a: torch.Tensor, bs: list[torch.Tensor]) -> "Weights":
        """From B in the plain [S, R, out] layout, paired (a copy) where this dtype's kernels want it."""
        if pairs_b(a.dtype):
            return cls(a, [pair_rows(b).contiguous() for b in bs], paired=True)
        return cls(a, bs)


def _launch(fn, name: str, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor, w: Weights,
            index: list[torch.Tensor], n: int) -> None:
    """Call a kernel of lora_decode.c: x, y, then the token index arrays, n, then the weights' layout.
    x: [T, in]; y: [T, sum(out_g)]; rows of both contiguous."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and x.shape[1] == w.n_in and y.shape[1] == w.width
    assert x.dtype == y.dtype == w.a.dtype == dtype and w.paired == pairs_b(dtype)
    rc = fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), *[t.data_ptr() for t in index], n,
            w.a.data_ptr(), w.a.stride(0), w.max_rank, w.groups, w.n_in, w.b_ptrs, w.b_strides, w.outs)
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc} (max rank {w.max_rank}, groups {w.groups}, in {w.n_in})")


class LoraDecode:
    """y[t, cols of output g] += bs[g][s, :r]^T @ (a[s, :r, g] @ x[t]) for (t, s, r) in zip(tokens, slots,
    ranks), in place. tokens, slots, ranks: [n] (tokens distinct, ranks <= R). Requires supports(dtype)."""

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
    slots[i] and rank ranks[i]; y[t] += bs[g][s, :r]^T @ (a[s, :r, g] @ x[t]) for each, in place, every
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
    """Decode tokens whose whole LoRA the C base GEMM computes (c_gemm.GemmLora, gemm_lora.c): (t, s, r)
    for t, s, r in zip(tokens, slots, ranks), tokens distinct rows of a step of num_rows tokens.
    Requires supports_fused(dtype)."""

    def __init__(self, tokens: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, num_rows: int):
        tokens = tokens.to(torch.int64)
        self.row_slot = torch.full((num_rows,), -1, dtype=torch.int64)
        self.row_slot[tokens] = slots.to(torch.int64)
        self.row_rank = torch.zeros(num_rows, dtype=torch.int64)
        self.row_rank[tokens] = ranks.to(torch.int64)

    def __call__(self, w: Weights) -> c_gemm.GemmLora:
        assert w.fusable and w.paired
        return c_gemm.GemmLora(self.row_slot, self.row_rank, w.a, w.b_ptrs, w.b_strides, w.outs, w)
