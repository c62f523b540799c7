"""The packed bf16 GEMM (kernels/cpu/gemm.c): layout and results."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import gemm

pytestmark = pytest.mark.skipif(not gemm.supports(torch.bfloat16, 2), reason="no AVX512-BF16 C GEMM here")


def test_pack_layout():
    w = torch.arange(50 * 6, dtype=torch.float32).view(50, 6).to(torch.bfloat16)
    p = gemm.pack(w)
    assert p.shape == (2, 3, gemm.NB, 2)
    for n, k in [(0, 0), (0, 1), (47, 5), (48, 2), (49, 3)]:
        assert p[n // gemm.NB, k // 2, n % gemm.NB, k % 2] == w[n, k]
    assert (p[1, :, 2:] == 0).all()           # columns past N are zero


@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (64, 576, 1536), (100, 3072, 576), (5, 13, 8)])
def test_matches_fp32_reference(m, n, k):
    g = torch.Generator().manual_seed(m + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    y = gemm.Gemm(w)(x)
    ref = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all()
