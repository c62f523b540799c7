"""bench.bench_gemm_lora: each side runs the kernels the engine runs here and the command prints every side
against plain and writes its JSON."""
from __future__ import annotations

import json

import pytest
import torch

from bench import bench_gemm_lora
from kernels.cpu import gemm as c_gemm
from kernels.cpu import lora as c_lora


@pytest.mark.skipif(not (c_gemm.supports(torch.bfloat16, 576) and c_lora.supports(torch.bfloat16)),
                    reason="no C bf16 GEMM and LoRA kernels here")
def test_the_command_prints_every_side_against_plain(tmp_path, capsys):
    data = bench_gemm_lora.main(["--layers", "1", "--rows", "8", "--repeats", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for side in bench_gemm_lora.SIDES:
        assert f"{side:<12}:" in out and data["best_ms"][side] > 0
    assert json.loads((tmp_path / "gemm_lora.json").read_text())["ratio_to_plain"]["plain"] == 1.0
    assert (tmp_path / "gemm_lora.png").stat().st_size > 0


def test_a_side_with_adapters_changes_the_output():
    """The sides are not no-ops: rows with an adapter differ from the plain GEMM's."""
    if not (c_gemm.supports(torch.bfloat16, 576) and c_lora.supports(torch.bfloat16)):
        pytest.skip("no C bf16 GEMM and LoRA kernels here")
    g = bench_gemm_lora.Group(576, [576, 192, 192], 4, torch.Generator().manual_seed(0))
    x = torch.randn(4, 576).to(torch.bfloat16)
    sides = bench_gemm_lora.sides(4)
    plain = g.gemm(x)
    assert torch.equal(sides["no rows"](g, x), plain)
    for side in ("one adapter", "zipf", "distinct"):
        assert not torch.equal(sides[side](g, x), plain), side
