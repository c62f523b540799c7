"""Paged multi-LoRA Triton kernels (TRITON_INTERPRET=1 on CPU; on the GPU under `make gpu-check`) against
the fp32 torch reference."""
import pytest
import torch

from kernels.reference.paged_lora import ref_expand, ref_shrink, segments_to_indices
from kernels.triton import lora_ops
from tests.kernels.backends import on_device

PAGE = 256
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(autouse=True, params=["gpu-tiles", "wide-tiles"])
def tiles(request, monkeypatch):
    """Every case with the GPU's tiles (rank rows split over programs, k loops, several column blocks) and
    with the WIDE ones the interpreter runs the engine's tests with (one program per token and module)."""
    monkeypatch.setattr(lora_ops, "WIDE", request.param == "wide-tiles")


def make_adapters(ranks, n_in, n_out, dtype, seed=0):
    """Pack A [r, in] then B [out, r] per adapter into randomly ordered pages of one pool."""
    g = torch.Generator().manual_seed(seed)
    sizes = [r * (n_in + n_out) for r in ranks]
    npages = [-(-s // PAGE) for s in sizes]
    order = torch.randperm(sum(npages) + 3, generator=g)        # a few pages belong to nobody
    pool = torch.randn((sum(npages) + 3) * PAGE, generator=g).to(dtype)
    table = torch.zeros(len(ranks), max(npages), dtype=torch.long)
    used = 0
    for i, n in enumerate(npages):
        table[i, :n] = order[used:used + n]
        used += n
    a_off = torch.zeros(len(ranks), dtype=torch.long)
    b_off = torch.tensor([r * n_in for r in ranks], dtype=torch.long)
    scale = torch.rand(len(ranks), generator=g) + 0.5
    return pool, table, a_off, b_off, torch.tensor(ranks), scale


def spread(kind, n_tokens, n_adapters, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        idx = torch.arange(n_tokens) % n_adapters
    elif kind == "uniform":
        idx = torch.randint(0, n_adapters, (n_tokens,), generator=g)
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, n_adapters + 1).float() ** 1.2
        idx = torch.multinomial(p / p.sum(), n_tokens, replacement=True, generator=g)
    else:
        idx = torch.zeros(n_tokens, dtype=torch.long)
    idx[::5] = -1                                   # some base-model tokens in the batch
    return idx


CASES = [(rank, dtype, hidden, kind)
         for rank in (4, 16, 64) for kind in ("distinct", "uniform", "zipf", "identical")
         for dtype, hidden in ((torch.float32, 64), (torch.bfloat16, 96))]


@pytest.mark.parametrize("rank, dtype, hidden, kind", CASES)
def test_bgmv_shrink_expand(rank, dtype, hidden, kind):
    ranks = [rank, max(1, rank // 2), rank, max(1, rank // 4)]       # mixed ranks in one batch
    n_out = hidden + 32
    pool, table, a_off, b_off, rk, scale = make_adapters(ranks, hidden, n_out, dtype)
    idx = spread(kind, 10, len(ranks))
    x = torch.randn(10, hidden).to(dtype)
    v, _ = on_device(lora_ops.bgmv_shrink, x, pool, table, a_off, rk, idx, rank, PAGE)
    v_ref = ref_shrink(x, pool, table, a_off, rk, idx, rank, PAGE)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(v, v_ref, atol=atol * hidden ** 0.5, rtol=rtol)
    y = torch.randn(10, n_out + 8).to(dtype)
    y_ref = ref_expand(v_ref, y, pool, table, b_off, rk, scale, idx, 8, n_out, PAGE)
    y = on_device(lora_ops.bgmv_expand, v_ref, y, pool, table, b_off, rk, scale, idx, [8, 8 + n_out], PAGE)[1][1]
    torch.testing.assert_close(y.float(), y_ref, atol=atol * rank ** 0.5 * 4, rtol=rtol)


@pytest.mark.parametrize("rank, dtype, hidden, kind", CASES[::2])
def test_sgmv_shrink_expand(rank, dtype, hidden, kind):
    ranks = [rank, max(1, rank // 2), rank]
    n_out = hidden + 16
    pool, table, a_off, b_off, rk, scale = make_adapters(ranks, hidden, n_out, dtype, seed=1)
    lens = {"distinct": [5, 17, 3], "uniform": [8, 8, 8], "zipf": [20, 3, 1], "identical": [12, 12, 12]}[kind]
    seg_adapter = torch.tensor([0, 1, 2] if kind != "identical" else [1, 1, -1])
    seg_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    T = int(seg_start[-1])
    x = torch.randn(T, hidden).to(dtype)
    idx = segments_to_indices(seg_start, seg_adapter)
    v, _ = on_device(lora_ops.sgmv_shrink, x, pool, table, a_off, rk, seg_start, seg_adapter, rank, max(lens),
                     PAGE)
    v_ref = ref_shrink(x, pool, table, a_off, rk, idx, rank, PAGE)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(v, v_ref, atol=atol * hidden ** 0.5, rtol=rtol)
    y = torch.randn(T, n_out).to(dtype)
    y_ref = ref_expand(v_ref, y, pool, table, b_off, rk, scale, idx, 0, n_out, PAGE)
    y = on_device(lora_ops.sgmv_expand, v_ref, y, pool, table, b_off, rk, scale, seg_start, seg_adapter, [0, n_out],
                  max(lens), PAGE)[1][1]
    torch.testing.assert_close(y.float(), y_ref, atol=atol * rank ** 0.5 * 4, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_with_empty_segments_and_odd_ranks(dtype):
    """Ranks 1, 7, 33 and 64 in one launch (each spanning pages out of order); empty segments, a base-model
    segment and one adapter in two segments."""
    ranks = [1, 7, 33, 64]
    hidden, n_out = 64, 80
    pool, table, a_off, b_off, rk, scale = make_adapters(ranks, hidden, n_out, dtype, seed=2)
    lens = [0, 5, 0, 9, 3, 0, 4]
    seg_adapter = torch.tensor([0, 1, 2, 3, -1, 2, 2])
    seg_start = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    T = int(seg_start[-1])
    x = torch.randn(T, hidden).to(dtype)
    idx = segments_to_indices(seg_start, seg_adapter)
    v, _ = on_device(lora_ops.sgmv_shrink, x, pool, table, a_off, rk, seg_start, seg_adapter, 64, max(lens), PAGE)
    v_ref = ref_shrink(x, pool, table, a_off, rk, idx, 64, PAGE)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(v, v_ref, atol=atol * hidden ** 0.5, rtol=rtol)
    y = torch.randn(T, n_out).to(dtype)
    before = y.clone()
    y_ref = ref_expand(v_ref, y, pool, table, b_off, rk, scale, idx, 0, n_out, PAGE)
    y = on_device(lora_ops.sgmv_expand, v_ref, y, pool, table, b_off, rk, scale, seg_start, seg_adapter, [0, n_out],
                  max(lens), PAGE)[1][1]
    torch.testing.assert_close(y.float(), y_ref, atol=atol * 64 ** 0.5 * 4, rtol=rtol)
    assert torch.equal(y[14:17], before[14:17])          # the base-model segment is left alone


def make_group(ranks, n_in, outs, dtype, seed=3):
    """A fused group's G modules for each adapter in one pool: ranks[i][g] (0: adapter i lacks module g), A_g
    [r, in] then B_g [out_g, r] of each module one after another in adapter i's randomly ordered pages ->
    pool, table, and [G, A] a_off, b_off, rank, scale."""
    g = torch.Generator().manual_seed(seed)
    A, G = len(ranks), len(outs)
    a_off, b_off, rank = (torch.zeros(G, A, dtype=torch.long) for _ in range(3))
    sizes = []
    for i, rs in enumerate(ranks):
        off = 0
        for m, (r, n_out) in enumerate(zip(rs, outs)):
            a_off[m, i], b_off[m, i], rank[m, i] = off, off + r * n_in, r
            off += r * (n_in + n_out)
        sizes.append(max(off, 1))
    npages = [-(-s // PAGE) for s in sizes]
    order = torch.randperm(sum(npages) + 2, generator=g)
    pool = torch.randn((sum(npages) + 2) * PAGE, generator=g).to(dtype)
    table = torch.zeros(A, max(npages), dtype=torch.long)
    used = 0
    for i, n in enumerate(npages):
        table[i, :n] = order[used:used + n]
        used += n
    return pool, table, a_off, b_off, rank, torch.rand(G, A, generator=g) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_group_in_one_launch_each(dtype):
    """q, k, v of different widths in one shrink and one expand launch (decode and prefill), adapters of
    different ranks per module, one without k: each module's columns as the per-module reference gives them."""
    ranks = [(8, 4, 8), (16, 0, 2), (3, 5, 7)]
    hidden, outs = 64, (64, 32, 32)
    cols = [0, 64, 96, 128]
    pool, table, a_off, b_off, rk, scale = make_group(ranks, hidden, outs, dtype)
    max_rank = 16
    atol, rtol = TOL[dtype]
    idx = torch.tensor([0, 1, -1, 2, 1, 0, 2])
    seg_start, seg_adapter = torch.tensor([0, 3, 4, 9, 12]), torch.tensor([2, -1, 0, 1])
    for kind in ("decode", "prefill"):
        tokens = idx if kind == "decode" else segments_to_indices(seg_start, seg_adapter)
        x = torch.randn(len(tokens), hidden).to(dtype)
        y = torch.randn(len(tokens), 128).to(dtype)
        if kind == "decode":
            v, _ = on_device(lora_ops.bgmv_shrink, x, pool, table, a_off, rk, tokens, max_rank, PAGE)
        else:
            v, _ = on_device(lora_ops.sgmv_shrink, x, pool, table, a_off, rk, seg_start, seg_adapter, max_rank, 9,
                             PAGE)
        want = y.float().clone()
        for m in range(3):
            v_ref = ref_shrink(x, pool, table, a_off[m], rk[m], tokens, max_rank, PAGE)
            torch.testing.assert_close(v[:, m * max_rank:(m + 1) * max_rank], v_ref, atol=atol * hidden ** 0.5,
                                       rtol=rtol)
            want = ref_expand(v_ref, want, pool, table, b_off[m], rk[m], scale[m], tokens, cols[m], outs[m], PAGE)
        if kind == "decode":
            got = on_device(lora_ops.bgmv_expand, v, y, pool, table, b_off, rk, scale, tokens, cols, PAGE)[1][1]
        else:
            got = on_device(lora_ops.sgmv_expand, v, y, pool, table, b_off, rk, scale, seg_start, seg_adapter, cols,
                            9, PAGE)[1][1]
        torch.testing.assert_close(got.float(), want, atol=atol * max_rank ** 0.5 * 4, rtol=rtol)
        assert torch.equal(got[tokens < 0], y[tokens < 0]), "rows without an adapter are left alone"
