"""The fused C elementwise ops against the torch expressions they replace (bit for bit in bf16)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.rope import Rope
from kernels.cpu import elementwise as ew

pytestmark = pytest.mark.skipif(not ew.supports(torch.float32), reason="no C compiler here")
DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 0)]


def rows(t, h, dtype, seed=0):
    return (torch.randn(t, h, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm(dtype, tol):
    x = rows(37, 576, dtype)
    w = rows(1, 576, dtype, seed=1)[0]
    ref = w * F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)
    out = ew.rms_norm(x, w, 1e-5)
    # bf16: at most one rounding step apart where the fp32 sums differ in their last bit
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol if dtype == torch.float32 else 8e-3)
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.99
    strided = torch.cat([x, x], 1)[:, :576]                       # rows at a stride
    torch.testing.assert_close(ew.rms_norm(strided, w, 1e-5), out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_add_rms_norm_adds_in_place_then_normalises(dtype, tol):
    x, d = rows(37, 576, dtype), rows(37, 576, dtype, seed=2)
    w = rows(1, 576, dtype, seed=1)[0]
    summed = x + d
    out = ew.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(x, summed)                              # the residual add, rounded as torch's
    torch.testing.assert_close(out, ew.rms_norm(summed, w, 1e-5), atol=0, rtol=0)
    base, before = rows(37, 1152, dtype), rows(37, 1152, dtype)          # rows at a stride, both operands
    ew.add_rms_norm(base[:, :576], torch.cat([d, d], 1)[:, 576:], w, 1e-5)
    assert torch.equal(base[:, :576], before[:, :576] + d) and torch.equal(base[:, 576:], before[:, 576:])


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul(dtype, tol):
    gu = rows(19, 2 * 96, dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = ew.silu_mul(gu)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol if dtype == torch.float32 else 8e-3)
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_gelu_tanh_mul(dtype, tol):
    gu = rows(19, 2 * 96, dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    out = ew.gelu_tanh_mul(gu)
    # tanhf and torch's vectorised tanh differ in their last bits: a bf16 result may round one step apart
    torch.testing.assert_close(out, ref, atol=4e-6 if dtype == torch.float32 else 1e-4, rtol=1e-5 if dtype ==
                               torch.float32 else 8e-3)
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_at_extreme_gates(dtype):
    """Large finite gates of either sign, across the vector part and the scalar tail (I = 20): what torch
    gives, to the last bit in bf16 but for values below 1e-30 (large negative gates used to give NaN:
    a / (1 + e^-a) divided by an infinity that -ffast-math leaves undefined)."""
    gate = torch.tensor([-1e4, -100.0, -89.0, -88.0, -20.0, -1.0, 0.0, 1.0, 20.0, 88.0, 89.0, 100.0, 1e4,
                         -3e38, 3e38, -50.0, -100.0, 100.0, -89.0, 3.0])
    up = torch.linspace(-2, 2, 20)
    gu = torch.cat([gate, up]).to(dtype)[None]
    out, ref = ew.silu_mul(gu), F.silu(gu[:, :20]) * gu[:, 20:]
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-30, rtol=0 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_in_place_on_a_fused_qkv_view(dtype, tol):
    rope = Rope(64, 512, 10000.0, None, dtype)
    positions = torch.tensor([0, 5, 100, 511, 7])
    cos, sin = rope.tables(positions)
    qkv = rows(5, 9 * 64 + 2 * 3 * 64, dtype)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    ref = rope.apply(q.clone(), cos, sin)
    ew.rope_(q, cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous())
    torch.testing.assert_close(qkv[:, : 9 * 64].view(5, 9, 64), ref, atol=tol, rtol=tol)
    untouched = rows(5, 9 * 64 + 2 * 3 * 64, dtype)[:, 9 * 64:]
    torch.testing.assert_close(qkv[:, 9 * 64:], untouched, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [5, 150])     # 150 rows: the parallel copy
def test_write_kv_matches_index_put(dtype, n):
    from kernels.attention_metadata import AttentionMetadata
    from kernels.reference.attention import write_kv
    pages, bs, kvh, d = 40, 4, 3, 8
    storage = torch.zeros(pages, 2 * 2 * bs * kvh * d, dtype=dtype)           # 2 layers, K and V
    view = storage.view(pages, 2, 2, bs, kvh, d)
    qkv = rows(n, (4 + 2 * kvh) * d, dtype)                                     # k, v as views of a fused row
    k = qkv[:, 4 * d:(4 + kvh) * d].view(n, kvh, d)
    v = qkv[:, (4 + kvh) * d:].view(n, kvh, d)
    slots = torch.randperm(pages * bs, generator=torch.Generator().manual_seed(n))[:n]
    slot_page, slot_off = slots // bs, slots % bs
    ew.write_kv(view[:, 1, 0], view[:, 1, 1], k, v, slot_page, slot_off)
    ref = torch.zeros_like(storage).view(pages, 2, 2, bs, kvh, d)
    meta = AttentionMetadata(slot_page, slot_off, 0, None, None, [])
    write_kv(ref[:, 1, 0], ref[:, 1, 1], k, v, meta)
    assert torch.equal(view, ref) and view.abs().sum() > 0


@pytest.mark.parametrize("vocab", [1, 7, 49152])
def test_argmax_matches_torch_on_bf16_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(16, vocab, generator=g).to(torch.bfloat16)
    if vocab > 10:
        x[1, 9] = x[1, 3] = 1e30                       # a tie: the first index
        x[2, 7], x[2, 5] = float("nan"), float("nan")  # NaN counts as the largest, the first one wins
        x[3] = float("-inf")
        x[4] = -0.0
        x[4, 6] = 0.0                                  # -0 == +0: index 0
        x[5] = -3.0
        x[5, vocab - 1] = -2.5                         # all negative
        x[6, vocab - 1] = float("inf")
        x[7] = (torch.randn(vocab, generator=g) * 1e-40).to(torch.bfloat16)   # denormals
    wide = torch.cat([x, x], dim=1)[:, :vocab]         # rows at a stride
    for t in (x, wide):
        assert torch.equal(ew.argmax(t), t.argmax(-1))
