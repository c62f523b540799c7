"""y = x @ W^T for the base model's projections, with the weight packed once for the fastest kernel here.

bf16 on a CPU with AVX512-BF16: the C GEMM of kernels/cpu/csrc/gemm_avx512bf16.c (packed weights); on one with AVX2 and
FMA only (AMD Zen, older Intel), kernels/cpu/csrc/gemm_avx2.c (bf16 weights, fp32 compute). Otherwise, where
oneDNN has native bf16, its pre-packed ("reordered") weights, which skip the per-call re-layout of W that
`F.linear` pays (1.2-1.8x on the M=64 decode GEMMs). Other dtypes and CPUs use `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import gemm as c_gemm

_DECODE_M_HINT = 64   # oneDNN picks its blocking for this batch size; any M works


def _can_pack(dtype: torch.dtype) -> bool:
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class CpuLinear:
    """kernels.backend.LinearOp. weight: [out, in]. Call with x: [T, in] -> [T, out] in the weight's dtype.

    kernel: "c" (gemm_avx512bf16.c or gemm_avx2.c), "onednn", "torch", or None for the best one available."""

    def __init__(self, weight: torch.Tensor, kernel: str | None = None):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        if kernel is None:
            kernel = ("c" if c_gemm.supports(weight.dtype, self.in_features)
                      else "onednn" if _can_pack(weight.dtype) else "torch")
        self.kernel = kernel
        self.c = c_gemm.Gemm(weight) if kernel == "c" else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _DECODE_M_HINT) if kernel == "onednn" else None

    @property
    def takes_lora(self) -> bool:
        """Whether __call__ accepts a GemmLora (the C kernel adds those deltas before rounding)."""
        return self.c is not None and c_gemm.supports_lora()

    def __call__(self, x: torch.Tensor, lora: c_gemm.GemmLora | None = None) -> torch.Tensor:
        if self.c is not None:
            return self.c(x, lora)
        assert lora is None, "only the C GEMM adds LoRA deltas"
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        return F.linear(x, self.weight)
