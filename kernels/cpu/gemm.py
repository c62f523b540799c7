"""ctypes binding of the bf16 GEMMs: y = x @ W^T with W packed once.

Two variants, picked once per process by what the CPU has:
- AVX512-BF16 (gemm_avx512bf16.c): vdpbf16ps over 48-column blocks; with a GemmLora, the same GEMM also
  computes some rows' multi-LoRA (gemm_lora_avx512bf16.c). Measured against oneDNN's pre-packed bf16 GEMM
  on Zen 4 (no AMX): 15-20% faster for the M <= 512 row counts of decode steps, ~4% slower at 2048 rows.
  Where the CPU has AMX-BF16, the same packed weights run on AMX tiles instead (`amx`; on an AMX Xeon the
  whole engine ran 3.23x faster than on the vdpbf16ps tiles: `bench_engine --tiles`, docs/performance.md).
- AVX2 + FMA (gemm_avx2.c; AMD Zen, older Intel): bf16 stored in 16-column blocks, fp32 computed. There,
  torch's bf16 matmul has no native kernel and runs 6-9x slower than its fp32 one. It takes no GemmLora:
  there the decode kernel (lora.c) adds the rows' LoRA after it, which measured faster than computing it
  beside the tiles (docs/performance.md, 2026-11-28).
Both compute each output as one fp32 sum (over k in order; AMX in its own order), rounded once, so a row
never depends on the batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.cpu.build import has_amx_bf16, has_avx2_fma, has_avx512_bf16, load_functions

NB = 48            # columns per packed block, as compiled into gemm_avx512bf16.c
NB_AVX2 = 16       # as compiled into gemm_avx2.c
AMX_LIBRARIES = ("gemm_avx512bf16", "gemm_lora_avx512bf16", "decoder", "lora")    # each has its own switch


def amx(on: bool | None = None) -> bool:
    """Whether the AVX512-BF16 GEMMs (plain, with LoRA, and inside the C decoder) run their tiles on AMX:
    compiled in where the CPU has AMX-BF16, used where Linux grants the process the tile state, unless
    LORAPLEX_CPU_AMX=0. `on` switches all three libraries (tests and benchmarks compare both ways; the
    packed weights are the same). False where AMX is absent."""
    if not (has_avx512_bf16() and has_amx_bf16()):
        return False
    states = []
    for lib in AMX_LIBRARIES:
        fns = load_functions(lib, {"amx": "gemm_amx"})
        if fns is not None:
            states.append(bool(fns["amx"](-1 if on is None else int(on))))
    return bool(states) and all(states)





@functools.cache
def variant(name: str) -> dict | None:
    """{"plain": fn, "nb": block columns[, "lora": fn, "v_cols": fn, "paired": bool]} of GEMM variant `name`
    ("avx512bf16" or "avx2"; only the first takes a LoRA), or None where this CPU lacks it or it cannot be built.
    v_cols(R, G): the int32 columns of the LoRA call's scratch per row (bf16 pairs); paired: whether
    its B is in the paired layout."""
    if name == "avx512bf16" and has_avx512_bf16():
        fns = load_functions("gemm_avx512bf16", {"plain": "gemm_bf16"})
        lora = load_functions("gemm_lora_avx512bf16", {"lora": "gemm_lora_bf16"}) if fns is not None else None
        v_cols = {"v_cols": lambda r, g: (r + 1) // 2 * g, "paired": True} if lora else {}
        return None if fns is None else {**fns, **(lora or {}), **v_cols, "nb": NB}
    if name == "avx2" and has_avx2_fma():
        fns = load_functions("gemm_avx2", {"plain": "gemm_bf16_avx2"})
        return None if fns is None else {**fns, "nb": NB_AVX2}
    return None


def variants() -> list[str]:
    """The GEMM variants that run here, fastest first (an AVX512-BF16 CPU runs the AVX2 one too)."""
    return [v for v in ("avx512bf16", "avx2") if variant(v) is not None]


def _fns() -> dict | None:
    """The variant the engine uses: the fastest one here (the others are not built)."""
    return next((fns for fns in map(variant, ("avx512bf16", "avx2")) if fns is not None), None)


def _fn():
    fns = _fns()
    return None if fns is None else fns["plain"]


@dataclass
class GemmLora:
    """The multi-LoRA of some rows, for Gemm.__call__ to compute inside the GEMM (gemm_lora_avx512bf16.c):
    row t with slot[t] >= 0 gets y[t, cols of output g] += Bt_g(s)[:r]^T @ (A(s)[:r, g] @ x[t]),
    s = slot[t], r = rank[t]. slot, rank: [M] int64; a, b: addresses of the slots' pointer tables (lora.Weights:
    a[s] -> A [R_s, G, K], b[s * G + g] -> Bt [R_s, out_g], on AVX512-BF16 paired [ceil(R_s / 2), out_g, 2]);
    max_rank: the largest R_s; outs: ctypes array of the G output widths (multiples of 16, summing to N; see
    kernels/cpu/csrc/lora_avx512bf16.h)."""
    slot: torch.Tensor
    rank: torch.Tensor
    a: int
    max_rank: int
    groups: int
    in_features: int
    b: int
    outs: object
    paired: bool
    owner: object = None   # what keeps the tables behind a and b alive (the lora.Weights)


def supports(dtype: torch.dtype, in_features: int) -> bool:
    return dtype == torch.bfloat16 and in_features % 2 == 0 and _fn() is not None


def supports_lora() -> bool:
    """Whether Gemm.__call__ takes a GemmLora here."""
    fns = _fns()
    return fns is not None and "lora" in fns


def pack(weight: torch.Tensor, nb: int = NB) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / nb), K / 2, nb, 2] (zero columns past N)."""
    n, k = weight.shape
    blocks = -(-n // nb)
    w = torch.zeros(blocks * nb, k, dtype=weight.dtype)
    w[:n] = weight
    return w.view(blocks, nb, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class Gemm:
    """y = x @ weight^T for x: [M, K] (rows contiguous) -> [M, N] bf16. Requires supports(), or a `kind`
    from variants() (tests run each variant here; the engine takes the fastest)."""

    def __init__(self, weight: torch.Tensor, kind: str | None = None):
        self.out_features, self.in_features = weight.shape
        self.fns = _fns() if kind is None else variant(kind)
        self.packed = pack(weight, self.fns["nb"])
        self.packed_ptr = self.packed.data_ptr()
        self.fn = self.fns["plain"]

    def __call__(self, x: torch.Tensor, lora: GemmLora | None = None) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.in_features and x.dtype == torch.bfloat16
        if x.stride(-1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=x.dtype)
        args = (x.data_ptr(), x.stride(0), self.packed_ptr, y.data_ptr(), y.stride(0), m, self.in_features,
                self.out_features)
        if lora is None:
            rc = self.fn(*args)
        else:
            r, g = lora.max_rank, lora.groups
            assert lora.slot.shape == lora.rank.shape == (m,) and lora.in_features == self.in_features
            assert lora.paired == self.fns["paired"], "this GEMM reads B in the other layout"
            v = torch.empty(m, self.fns["v_cols"](r, g), dtype=torch.int32)   # the shrinks' results (scratch)
            rc = self.fns["lora"](*args, lora.slot.data_ptr(), lora.rank.data_ptr(), lora.a, r, g, lora.b, lora.outs,
                                  v.data_ptr(), v.stride(0))
        if rc != 0:
            name = "gemm" if lora is None else "gemm_lora_bf16"
            raise RuntimeError(f"{name} failed with code {rc} (K={self.in_features}, N={self.out_features})")
        return y
