"""Every Linear kernel gives what F.linear gives; the C GEMM rounds each output once from an fp32 sum."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import gemm as c_gemm
from kernels.cpu.linear import CpuLinear as Linear
from kernels.cpu.linear import _can_pack

KERNELS = [pytest.param("onednn", marks=pytest.mark.skipif(not _can_pack(torch.bfloat16),
                                                           reason="no native bf16 oneDNN on this CPU")),
           pytest.param("c", marks=pytest.mark.skipif(not c_gemm.supports(torch.bfloat16, 2),
                                                      reason="no AVX512-BF16 C GEMM here"))]


def _data(m, out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, in_f, generator=g).to(torch.bfloat16)
    return w, x


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 3, 64, 130, 2048])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (40, 24)])
def test_kernel_equals_f_linear(kernel, m, out_f, in_f):
    w, x = _data(m, out_f, in_f, seed=m)
    lin = Linear(w, kernel=kernel)
    assert lin.kernel == kernel
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-2, rtol=1e-2)
    assert lin(x[::2]).shape == (len(x[::2]), out_f)          # non-contiguous input


@pytest.mark.parametrize("kernel", KERNELS[1:])
@pytest.mark.parametrize("out_f", [1, 47, 48, 49, 100])
def test_c_gemm_rounds_fp32_sums_once(kernel, out_f):
    w, x = _data(37, out_f, 64, seed=out_f)
    y = Linear(w, kernel=kernel)(x)
    ref = x.float() @ w.float().T
    # within one bf16 rounding of the fp32 result (summation order differs only in fp32)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all()


@pytest.mark.parametrize("kernel", KERNELS[1:])
def test_c_gemm_rows_do_not_depend_on_the_batch(kernel):
    w, x = _data(200, 960, 576)
    lin = Linear(w, kernel=kernel)
    full = lin(x)
    for lo, hi in [(0, 1), (5, 13), (64, 200), (100, 101)]:
        assert torch.equal(lin(x[lo:hi]), full[lo:hi])


def test_float32_uses_torch():
    w = torch.randn(8, 4)
    lin = Linear(w)
    assert lin.kernel == "torch"
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(x), x @ w.T)
