"""The base GEMM that computes its decode rows' multi-LoRA itself (kernels/cpu/csrc/gemm_lora_avx512bf16.c; the
AVX2 GEMM takes none: there the decode kernel runs after it)."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import gemm
from kernels.cpu import lora as c_lora

pytestmark = [pytest.mark.skipif(not c_lora.supports_fused(torch.bfloat16), reason="no C GEMM with LoRA here"),
              pytest.mark.usefixtures("amx_tiles")]

KINDS = [k for k in gemm.variants() if "lora" in gemm.variant(k)]   # the engine's (fastest) first


def lora_gemm(w, a, bs, kind):
    """(the GEMM of variant `kind`, the adapters in the layout it reads: Weights.of(paired=True) takes B already
    paired)"""
    paired = gemm.variant(kind)["paired"]
    if paired:
        bs = [c_lora.pair_rows(b).contiguous() for b in bs]
    return gemm.Gemm(w, kind), c_lora.Weights.of(a, bs, paired=paired)


def case(slots, rank, n_in, outs, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(slots, rank, len(outs), n_in, generator=g) * 0.05).to(torch.bfloat16)
    bs = [(torch.randn(slots, rank, o, generator=g) * 0.05).to(torch.bfloat16) for o in outs]
    w = (torch.randn(sum(outs), n_in, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, n_in, generator=g).to(torch.bfloat16)
    tokens = torch.randperm(m, generator=g)[: max(1, 2 * m // 3)]
    row_slots = torch.randint(0, slots, (len(tokens),), generator=g)
    ranks = torch.randint(1, rank + 1, (len(tokens),), generator=g)
    return a, bs, w, x, tokens, row_slots, ranks


def reference(a, bs, w, x, tokens, row_slots, ranks):
    """fp32 sums; the intermediate A x rounded to bf16, as a bf16 LoRA (PEFT's too) keeps it"""
    ref = x.float() @ w.float().T
    for t, s, r in zip(tokens.tolist(), row_slots.tolist(), ranks.tolist()):
        v = a[s, :r].float() @ x[t].float()   # [r, G]
        v = v.to(torch.bfloat16).float()
        col = 0
        for g, b in enumerate(bs):
            ref[t, col:col + b.shape[2]] += v[:, g] @ b[s, :r].float()
            col += b.shape[2]
    return ref


# decode groups of SmolLM2 (qkv, o, gate_up, down), more rows than one row block, a single row
@pytest.mark.parametrize("slots,rank,n_in,outs,m", [(6, 16, 576, [576, 192, 192], 20), (5, 16, 1536, [576], 64),
                                                    (8, 16, 576, [1536, 1536], 70), (8, 8, 576, [576, 192, 192], 200),
                                                    (3, 4, 96, [32, 16, 16], 1), (4, 64, 64, [48], 9)])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_fp32_reference(slots, rank, n_in, outs, m, kind):
    a, bs, w, x, tokens, row_slots, ranks = case(slots, rank, n_in, outs, m)
    lin, weights = lora_gemm(w, a, bs, kind)
    y = lin(x, c_lora.LoraRows(tokens, row_slots, ranks, m)(weights))
    ref = reference(a, bs, w, x, tokens, row_slots, ranks)
    # bf16 output: one rounding, or two (of the base, then of the sum) in the columns whose expand runs
    # after their tiles
    base = (x.float() @ w.float().T).abs()
    assert ((y.float() - ref).abs() <= (ref.abs() + base) * 2 ** -8 + 1e-3).all()
    plain = lin(x)
    others = sorted(set(range(m)) - set(tokens.tolist()))
    assert torch.equal(y[others], plain[others])              # rows without an adapter: the plain GEMM
    assert not torch.equal(y[tokens], plain[tokens])


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_its_batch(kind):
    a, bs, w, x, tokens, row_slots, ranks = case(6, 16, 576, [576, 192, 192], 40, seed=3)
    lin, weights = lora_gemm(w, a, bs, kind)
    y = lin(x, c_lora.LoraRows(tokens, row_slots, ranks, 40)(weights))
    for i in (0, 7):
        t = int(tokens[i])
        alone = lin(x[t:t + 1], c_lora.LoraRows(torch.tensor([0]), row_slots[i:i + 1], ranks[i:i + 1], 1)(weights))
        assert torch.equal(alone[0], y[t])


def test_outputs_must_be_whole_vectors():
    a = torch.zeros(2, 4, 1, 32, dtype=torch.bfloat16)
    weights = c_lora.Weights.of(a, [torch.zeros(2, 4, 24, dtype=torch.bfloat16)])
    assert not weights.fusable
    with pytest.raises(AssertionError):
        c_lora.LoraRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([4]), 1)(weights)


@pytest.mark.parametrize("slots,rank,n_in,outs,m", [(6, 16, 576, [576, 192, 192], 20), (5, 12, 1536, [576], 9),
                                                    (4, 8, 576, [1536, 1536], 13), (3, 5, 96, [32, 16, 16], 6)])
def test_a_token_gets_the_same_bits_on_every_lora_path(slots, rank, n_in, outs, m):
    """Inside the GEMM (decode tokens), after it per token (the decode kernel), or in a prefill segment:
    the same bits, so a token's output does not depend on how the scheduler chunked its prompt (a
    one-token chunk runs as a decode token). Ranks not multiples of 16 or of 2 included. (The engine's
    variant: the per-token kernels read B in its layout.)"""
    a, bs, w, x, tokens, row_slots, ranks = case(slots, rank, n_in, outs, m, seed=5)
    weights, lin = c_lora.Weights.of(a, bs), gemm.Gemm(w)
    fused = lin(x, c_lora.LoraRows(tokens, row_slots, ranks, m)(weights))
    per_token = lin(x)
    c_lora.LoraDecode(tokens, row_slots, ranks, torch.bfloat16)(x, per_token, weights)
    assert torch.equal(fused, per_token)
    if c_lora.supports_segments(torch.bfloat16) and not c_lora.segments_on_amx(torch.bfloat16):
        # (on AMX the segment kernel runs every token, decode tokens too, in AMX's order: lora_amx.h)
        segments = lin(x)
        for t, s, r in zip(tokens.tolist(), row_slots.tolist(), ranks.tolist()):   # one segment per token
            c_lora.LoraSegments(torch.tensor([t]), torch.tensor([0, 1]), torch.tensor([s]), torch.tensor([r]),
                                torch.bfloat16)(x, segments, weights)
        assert torch.equal(segments, per_token)
        order = torch.argsort(row_slots, stable=True)                             # and grouped by adapter
        seg_slots, counts = torch.unique_consecutive(row_slots[order], return_counts=True)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        grouped = lin(x)
        same_rank = torch.full_like(seg_slots, rank)
        toks = tokens[order]
        c_lora.LoraSegments(toks, starts, seg_slots, same_rank, torch.bfloat16)(x, grouped, weights)
        full = lin(x, c_lora.LoraRows(toks, row_slots[order], torch.full_like(toks, rank), m)(weights))
        assert torch.equal(grouped, full)


@pytest.mark.parametrize("n_in,outs", [(576, [576, 192, 192]), (1536, [576]), (96, [32, 16, 16])])
def test_rows_sharing_an_adapter_get_the_bits_each_gets_alone(n_in, outs):
    """Rows side by side on one adapter and rank (the engine orders a step's rows by adapter) are computed
    together, each weight load serving up to four of them: every row still gets the bits of the decode
    kernel and of the row alone. Runs of 9 (4 + 4 + 1), 2, 1, 5, 6 rows, and a run of one slot whose rank
    changes (two groups)."""
    a, bs, w, x, *_ = case(4, 16, n_in, outs, 27, seed=7)
    slots = [0] * 9 + [1] * 2 + [2] + [3] * 5 + [0] * 6 + [1] * 4
    rank_of = {0: 16, 1: 7, 2: 3, 3: 12}
    ranks = [rank_of[s] for s in slots[:-2]] + [5, 5]
    tokens, row_slots, row_ranks = torch.arange(len(slots)), torch.tensor(slots), torch.tensor(ranks)
    weights, lin = c_lora.Weights.of(a, bs), gemm.Gemm(w)
    fused = lin(x, c_lora.LoraRows(tokens, row_slots, row_ranks, len(slots))(weights))
    per_token = lin(x)
    c_lora.LoraDecode(tokens, row_slots, row_ranks, torch.bfloat16)(x, per_token, weights)
    assert torch.equal(fused, per_token)
    for t in (0, 3, 8, 10, 13, 20, 26):
        alone = lin(x[t:t + 1], c_lora.LoraRows(torch.tensor([0]), row_slots[t:t + 1], row_ranks[t:t + 1], 1)(weights))
        assert torch.equal(alone[0], fused[t])
    assert not torch.equal(fused, lin(x))
