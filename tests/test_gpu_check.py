"""`make gpu-check` fails when anything in it fails (each step is piped into tee): a stand-in interpreter
that passes the device check and fails every later step makes it exit non-zero."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(tmp_path, steps: str) -> tuple[subprocess.CompletedProcess, str]:
    """`make gpu-check` with a stand-in interpreter that passes the device check and runs `steps` (bash) for
    every later step -> (the run, what it wrote to GPU_CHECK_OUT)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\nif [ "$1" = "-c" ]; then echo "Stand-in GPU torch 0"; exit 0; fi\n' + steps)
    fake.chmod(0o755)
    out = tmp_path / "gpu-check.txt"
    run = subprocess.run(["make", "-s", "gpu-check", f"GPU_PY={fake}", f"GPU_CHECK_OUT={out}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    return run, out.read_text()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_gpu_check_exits_non_zero_when_a_step_fails(tmp_path):
    run, text = gpu_check(tmp_path, 'echo "stand-in step failed: $*"; exit 3\n')
    assert run.returncode != 0, run.stdout + run.stderr
    assert "Stand-in GPU" in text and "stand-in step failed: -m pytest" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_gpu_check_runs_every_step_and_its_last_one_can_fail_it(tmp_path):
    """A stand-in whose steps all pass but the server check: every step ran, in order, and the target fails."""
    run, text = gpu_check(tmp_path, 'echo "step: $*"; case "$*" in *serve_check*) exit 4;; esac; exit 0\n')
    assert run.returncode != 0, run.stdout + run.stderr
    steps = [line.split()[2] for line in text.splitlines() if line.startswith("step: -m")]
    assert steps == ["pytest", "bench.bench_engine", "bench.bench_lora", "bench.bench_attention", "bench.bench_peft",
                     "bench.bench_coldstart", "bench.serve_check"], steps
