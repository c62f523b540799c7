"""The C multi-LoRA decode kernel against an fp32 per-token reference."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import lora as c_lora

pytestmark = pytest.mark.skipif(not c_lora.supports(torch.float32), reason="no C compiler here")


def make(S, R, n_in, outs, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(S, R, len(outs), n_in, generator=g).to(dtype)
    bs = [torch.randn(S, R, o, generator=g).to(dtype) for o in outs]
    return a, bs


def reference(x, y, tokens, slots, ranks, a, bs):
    out = y.float().clone()
    for t, s, r in zip(tokens.tolist(), slots.tolist(), ranks.tolist()):
        col = 0
        for g, b in enumerate(bs):
            v = a[s, :r, g].float() @ x[t].float()                       # [r]
            out[t, col:col + b.shape[2]] += b[s, :r].float().T @ v
            col += b.shape[2]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("outs", [(24,), (40, 8, 8), (33, 70)])
@pytest.mark.parametrize("R", [4, 16, 13])
def test_matches_reference(dtype, tol, outs, R):
    S, n_in, T = 6, 37, 9
    a, bs = make(S, R, n_in, outs, dtype, seed=R)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, n_in, generator=g).to(dtype)
    y = torch.randn(T, sum(outs), generator=g).to(dtype)
    tokens = torch.tensor([7, 0, 3, 5, 8])                  # distinct rows, any order; rows 1, 2, 4, 6 untouched
    slots = torch.tensor([2, 5, 2, 0, 1])                   # a slot may serve several tokens
    ranks = torch.tensor([R, 1, R - 1, 0, 3])               # each adapter's own rank, 0 = no-op
    ref = reference(x, y, tokens, slots, ranks, a, bs)
    c_lora.LoraDecode(tokens, slots, ranks, dtype)(x, y, c_lora.Weights.of(a, bs))
    torch.testing.assert_close(y.float(), ref, atol=tol * 4, rtol=tol)


def test_strided_rows_and_slot_views():
    """x / y as column slices of wider buffers and weights as one layer of a [L, S, ...] buffer."""
    L, S, R, n_in, outs = 3, 4, 8, 16, (12, 20)
    a_all = torch.randn(L, S, R, len(outs), n_in)
    b_all = [torch.randn(L, S, R, o) for o in outs]
    wide_x = torch.randn(5, n_in + 7)
    wide_y = torch.zeros(5, sum(outs) + 3)
    x, y = wide_x[:, 2:2 + n_in], wide_y[:, :sum(outs)]
    tokens, slots, ranks = torch.tensor([4, 1]), torch.tensor([3, 0]), torch.tensor([8, 5])
    ref = reference(x, y, tokens, slots, ranks, a_all[1], [b[1] for b in b_all])
    c_lora.LoraDecode(tokens, slots, ranks, torch.float32)(x, y, c_lora.Weights.of(a_all[1], [b[1] for b in b_all]))
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(wide_y[:, sum(outs):], torch.zeros(5, 3))


def test_rank_above_max_is_refused():
    a, bs = make(2, 4, 8, (8,), torch.float32, 0)
    call = c_lora.LoraDecode(torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), torch.float32)
    with pytest.raises(RuntimeError, match="code -3"):
        call(torch.randn(1, 8), torch.zeros(1, 8), c_lora.Weights.of(a, bs))


def test_ranks_beyond_the_compiled_limit_fall_back():
    from kernels.cpu import lora_batch
    from kernels.cpu.paged_adapters import CpuPagedAdapters
    from tests.engine.lora.synthetic import TINY
    assert c_lora.fits(256, 8192) and not c_lora.fits(257, 8192)
    pool = torch.zeros(1, 1)
    assert not lora_batch.use_c_kernel(CpuPagedAdapters(512, TINY, pool))
    assert lora_batch.use_c_kernel(CpuPagedAdapters(16, TINY, pool))


@pytest.mark.skipif(not c_lora.supports_segments(torch.bfloat16), reason="no AVX512-BF16 or AVX2 here")
@pytest.mark.parametrize("outs,R,n_in", [((24,), 4, 37), ((40, 8, 8), 13, 64), ((33, 70), 16, 100)])
def test_segments_match_reference_and_do_not_depend_on_the_batch(outs, R, n_in):
    S, T = 6, 23
    a, bs = make(S, R, n_in, outs, torch.bfloat16, seed=R)
    w = c_lora.Weights.of(a, bs)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, n_in, generator=g).to(torch.bfloat16)
    y0 = torch.randn(T, sum(outs), generator=g).to(torch.bfloat16)
    # segments of 1, 4, 7 and 9 tokens (tiles of 4 with tails), any rows, one with rank 0; rows 21, 22 untouched
    seg_tokens = [[3], [0, 1, 2, 4], [5, 6, 7, 8, 9, 10, 11], [12, 20, 13, 14, 15, 16, 17, 18, 19]]
    slots, ranks = [2, 0, 5, 2], [R, R - 1, 0, 3]
    tokens = torch.tensor([t for seg in seg_tokens for t in seg])
    starts = torch.tensor([0, *torch.tensor([len(s) for s in seg_tokens]).cumsum(0).tolist()])
    y = y0.clone()
    c_lora.LoraSegments(tokens, starts, torch.tensor(slots), torch.tensor(ranks), torch.bfloat16)(x, y, w)
    tok_slots = torch.tensor([s for seg, s in zip(seg_tokens, slots) for _ in seg])
    tok_ranks = torch.tensor([r for seg, r in zip(seg_tokens, ranks) for _ in seg])
    ref = reference(x, y0, tokens, tok_slots, tok_ranks, a, bs)
    torch.testing.assert_close(y.float(), ref, atol=0.2, rtol=5e-2)
    assert torch.equal(y[21:], y0[21:])
    # each token on its own: alone in a one-token segment it gets exactly the same result
    for t, s, r in [(13, 2, 3), (9, 5, 0), (4, 0, R - 1)]:
        alone = y0.clone()
        c_lora.LoraSegments(torch.tensor([t]), torch.tensor([0, 1]), torch.tensor([s]), torch.tensor([r]),
                            torch.bfloat16)(x, alone, w)
        assert torch.equal(alone[t], y[t])
    if not c_lora.pairs_b(torch.bfloat16):
        # AVX2: the decode kernel computes every token in the same order, so it gives the same bits
        per_token = y0.clone()
        c_lora.LoraDecode(tokens, tok_slots, tok_ranks, torch.bfloat16)(x, per_token, w)
        assert torch.equal(per_token, y)
