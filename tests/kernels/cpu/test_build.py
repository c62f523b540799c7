"""Loading the C kernels must leave the process's floating-point state alone: a library linked with
-ffast-math would turn on flush-to-zero / denormals-are-zero for everything in the process."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kernels.cpu import build


@pytest.mark.skipif(not build.has_avx2_fma(), reason="the C kernels need AVX2 + FMA")
def test_loading_a_kernel_keeps_subnormal_floats():
    code = ("import sys\nfrom kernels.cpu import build\nassert sys.float_info.min / 4 > 0\n"
            "build.build('elementwise')\nprint(sys.float_info.min / 4 > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stdout + out.stderr[-2000:]
