"""The packed bf16 GEMM (kernels/cpu/gemm.c): layout, results, and LoRA prefetch that never changes them."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import gemm
from kernels.cpu.lora import LoraDecode, Weights

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


def _lora_weights(S=6, R=8, outs=(96, 32, 32), n_in=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(S, R, len(outs), n_in, generator=g) * 0.1).to(torch.bfloat16)
    bs = [(torch.randn(S, R, o, generator=g) * 0.1).to(torch.bfloat16) for o in outs]
    return Weights(a, bs)


def test_plan_describes_the_slot_layout():
    w = _lora_weights()
    p = w.plan
    assert p.a == w.a.data_ptr() and p.a_slot == w.a.stride(0) * 2 and p.a_rank == 3 * 64 * 2 and p.groups == 3
    for g, b in enumerate(w.bs):
        assert p.b[g] == b.data_ptr() and p.b_slot[g] == b.stride(0) * 2 and p.b_rank[g] == b.shape[2] * 2


@pytest.mark.parametrize("ranks", [[8, 8, 8, 8], [0, 3, 8, 1], [0, 0, 0, 0]])
def test_prefetch_does_not_change_results(ranks):
    """The prefetch plan walks the listed adapters' bytes (rank 0 = nothing) while the GEMM runs."""
    w = _lora_weights()
    g = torch.Generator().manual_seed(1)
    base = gemm.Gemm((torch.randn(160, 64, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    decode = LoraDecode(torch.arange(4), torch.tensor([5, 0, 2, 5]), torch.tensor(ranks), torch.bfloat16)
    plain = base(x)
    assert torch.equal(base(x, decode.prefetch(w)), plain)
    y1, y2 = plain.clone(), base(x, decode.prefetch(w))
    decode(x, y1, w)
    decode(x, y2, w)
    assert torch.equal(y1, y2)
