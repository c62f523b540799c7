"""bench.bench_attention: both sides see the same cache contents and agree, on every backend that runs here."""
from __future__ import annotations

import pytest
import torch

from bench import bench_attention
from kernels.selector import select_backend
from tests.kernels.backends import available_backends


@pytest.mark.parametrize("name", [b for b in available_backends() if b != "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_backend_and_the_reference_compute_the_same_step(name, dtype):
    seqs = [(40, 1), (0, 9), (17, 5)]
    shape = bench_attention.default_shape(dtype)
    sides = [bench_attention.Side(select_backend(b, shape, "cpu"), seqs, 16, 2, seed=0) for b in (name, "torch")]
    q = torch.randn(15, shape.num_heads, shape.head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = (side.run(q) for side in sides)
    assert len(got) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2)


def test_the_command_prints_both_sides_and_their_ratio(capsys):
    if "cpu" not in available_backends():
        pytest.skip("no C kernels here")
    bench_attention.main(["--device", "cpu", "--scenario", "decode", "--layers", "1", "--repeats", "1"])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("decode") and " ms vs torch " in line and line.count("x (max |diff|") == 1
