"""The GEMM tile modes: tests that use `amx_tiles` run once with the AVX512-BF16 GEMMs' tiles on AMX (where
this CPU and kernel run AMX) and once on vdpbf16ps."""
from __future__ import annotations

import pytest

from kernels.cpu import gemm


@pytest.fixture(params=[True, False], ids=["amx", "vdpbf16ps"])
def amx_tiles(request):
    before = gemm.amx()
    if request.param and not before:
        pytest.skip("no AMX tiles here")
    gemm.amx(request.param)
    assert gemm.amx() == request.param
    yield request.param
    gemm.amx(before)
