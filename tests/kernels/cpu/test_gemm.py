"""The packed bf16 GEMM of this CPU (kernels/cpu/csrc/gemm_avx512bf16.c on AVX512-BF16, gemm_avx2.c on AVX2 + FMA):
layout, results and batch invariance."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import gemm

pytestmark = [pytest.mark.skipif(not gemm.variants(), reason="no C GEMM for this CPU"),
              pytest.mark.usefixtures("amx_tiles")]
KINDS = gemm.variants()   # every variant this CPU runs: an AVX512-BF16 CPU tests the AVX2 one too


@pytest.mark.parametrize("nb", [gemm.NB, gemm.NB_AVX2])
def test_pack_layout(nb):
    w = torch.arange(50 * 6, dtype=torch.float32).view(50, 6).to(torch.bfloat16)
    p = gemm.pack(w, nb)
    blocks = -(-50 // nb)
    assert p.shape == (blocks, 3, nb, 2)
    for n, k in [(0, 0), (0, 1), (15, 5), (16, 2), (47, 5), (48, 2), (49, 3)]:
        assert p[n // nb, k // 2, n % nb, k % 2] == w[n, k]
    assert (p[-1, :, 50 % nb:] == 0).all()           # columns past N are zero


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (64, 576, 1536), (100, 3072, 576), (5, 13, 8), (13, 40, 34),
                                   (17, 50, 70), (33, 100, 96)])
def test_matches_fp32_reference(m, n, k, kind):
    g = torch.Generator().manual_seed(m + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    y = gemm.Gemm(w, kind)(x)
    ref = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_do_not_depend_on_the_batch(kind):
    """gemm_avx2.c: one row runs the in-register tile, many rows the widened panel: the same bits."""
    g = torch.Generator().manual_seed(7)
    lin = gemm.Gemm((torch.randn(200, 96, generator=g) * 0.1).to(torch.bfloat16), kind)
    x = torch.randn(257, 96, generator=g).to(torch.bfloat16)
    full = lin(x)
    for rows in [slice(0, 1), slice(3, 10), slice(100, 257), slice(5, 6), slice(7, 40)]:
        assert torch.equal(lin(x[rows]), full[rows])


@pytest.mark.parametrize("kind", KINDS)
def test_strided_input_rows(kind):
    g = torch.Generator().manual_seed(3)
    lin = gemm.Gemm((torch.randn(32, 64, generator=g) * 0.1).to(torch.bfloat16), kind)
    x = torch.randn(10, 128, generator=g).to(torch.bfloat16)[:, 32:96]   # rows at stride 128
    assert torch.equal(lin(x), lin(x.contiguous()))


def test_amx_tiles_agree_with_vdpbf16ps_tiles():
    """Where AMX runs: both tile kinds give each output as one fp32 sum rounded once, so they differ at most
    by the order of additions (a bf16 rounding apart here and there), over k tails and row tails."""
    if not gemm.amx(True):           # the amx_tiles fixture puts back what it found
        pytest.skip("no AMX tiles here")
    g = torch.Generator().manual_seed(11)
    for m, n, k in [(1, 96, 64), (37, 200, 600), (16, 48, 32), (70, 1536, 576)]:
        lin = gemm.Gemm((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        on = lin(x)
        gemm.amx(False)
        off = lin(x)
        gemm.amx(True)
        assert (on.float() - off.float()).abs().max() <= off.float().abs().max() * 2 ** -7
        assert (on != off).float().mean() < 0.1
