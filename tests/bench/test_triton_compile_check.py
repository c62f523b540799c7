"""The Triton kernels compile for real GPU targets (sm_80, sm_90) as the engine launches them, with no GPU:
the interpreter that runs them in the other tests never compiles anything. ptxas's register report says
none of them spills, and each leaves room for 16 resident warps per SM, at the default model's shape.
Runs in a subprocess, since triton reads TRITON_INTERPRET (set for this process by tests/conftest.py)
once, at import."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

KERNELS = {"_bgmv_shrink_kernel", "_bgmv_expand_kernel", "_sgmv_shrink_kernel", "_sgmv_expand_kernel",
           "_paged_attention_kernel", "_combine_splits_kernel"}


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")       # compile for real, not from a cache
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


def test_every_kernel_compiles_as_launched_for_sm80_and_sm90_without_spilling(tmp_path):
    r = run(tmp_path, "-m", "bench.triton.compile_check", "--quick")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("ok ")]
    usage = [re.search(r"(\d+) registers, spills (\d+) B, (\d+)/(\d+) warps per SM", line) for line in lines]
    assert all(usage), lines
    assert all(0 < int(u[1]) <= 255 and u[2] == "0" and 0 < int(u[3]) <= int(u[4]) == 64 for u in usage), lines
    assert min(int(u[3]) for u in usage) >= 16, lines     # no kernel so register-hungry that 2 blocks fill an SM
    ok = [line.split() for line in lines]
    assert {f[1] for f in ok} == KERNELS
    assert {f[2] for f in ok} == {"*bf16", "*fp32"}
    targets = {line[line.index(" sm_") + 1:].split(":")[0] for line in r.stdout.splitlines() if line.startswith("ok ")}
    assert targets == {"sm_80", "sm_90"}
    assert "0 failure(s)" in r.stdout


def test_the_check_reports_a_kernel_that_does_not_compile_or_fit(tmp_path):
    code = textwrap.dedent("""
        import io
        from bench.triton import compile_check as cc
        good = cc.record_step(cc.SHAPES[0], cc.torch.float32, 64)
        shrink = next(x for x in good if x.name == "_sgmv_shrink_kernel")
        wrong = tuple((n, "i32" if n == "pool_ptr" else t) for n, t in shrink.signature)
        mistyped = cc.Launch(shrink.kernel, wrong, shrink.constexprs)
        small = ("sm_90-with-1-KiB", 90, 1024)        # a target whose shared memory the kernel exceeds
        for failure in cc.compile_all({shrink, mistyped}, targets=(cc.TARGETS[2], small), out=io.StringIO()):
            print(failure)
    """)
    r = run(tmp_path, "-c", code)
    assert r.returncode == 0, r.stderr[-4000:]
    failures = r.stdout.strip().splitlines()
    assert len(failures) == 3, r.stdout    # the mistyped launch on both targets, the good one on the small one
    assert sum("sm_90-with-1-KiB" in f and "shared memory, the target has 1024" in f for f in failures) == 1
    assert sum(f.startswith("_sgmv_shrink_kernel") and "CompilationError" in f for f in failures) == 2, failures
