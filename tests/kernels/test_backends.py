"""Conformance: every op of every backend that runs here against the reference (torch) backend, with
per-dtype tolerances (kernels/backend.py documents each op)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata, MetadataBuilder
from kernels.reference.backend import TorchBackend
from tests.kernels.backends import BACKEND_CLASSES, DEVICE, SHAPE, TOL, available_backends, backend

BACKENDS = [b for b in available_backends() if b != "torch"]
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.skipif(not BACKENDS, reason="only the reference backend runs here")


def overriding(*methods: str) -> list[str]:
    """The backends here that implement one of `methods` themselves: a backend that inherits the reference's
    op is not compared with it (that comparison could not fail)."""
    return [b for b in BACKENDS if any(getattr(BACKEND_CLASSES[b], m) is not getattr(TorchBackend, m)
                                       for m in methods)]


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype=dtype, device=DEVICE)


def close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", overriding("linear"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_linear(name, dtype, rows):
    w, x = randn(96, 128, dtype=dtype, scale=0.1), randn(rows, 128, dtype=dtype, seed=1)
    close(backend(name, dtype).linear(w)(x), backend("torch", dtype).linear(w)(x), dtype)


@pytest.mark.parametrize("name", overriding("rms_norm", "add_rms_norm"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms(name, dtype):
    b, ref = backend(name, dtype), backend("torch", dtype)
    x, d, w = randn(9, 128, dtype=dtype), randn(9, 128, dtype=dtype, seed=1), randn(128, dtype=dtype, seed=2)
    close(b.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    x1, x2 = x.clone(), x.clone()
    close(b.add_rms_norm(x1, d, w, 1e-6), ref.add_rms_norm(x2, d, w, 1e-6), dtype)
    close(x1, x2, dtype)                                             # the residual stream, in place


@pytest.mark.parametrize("name", overriding("silu_mul"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(name, dtype):
    gu = randn(9, 2 * 192, dtype=dtype, seed=3)
    close(backend(name, dtype).silu_mul(gu), backend("torch", dtype).silu_mul(gu), dtype)


@pytest.mark.parametrize("name", overriding("dora_scale"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_dora_scale(name, dtype):
    """Rows with an offset get y + y * d (their own d, from anywhere in the pool); rows with -1 keep their bits."""
    storage = randn(6, 512, dtype=dtype, seed=4, scale=0.2)
    y = randn(9, 96, dtype=dtype, seed=5)
    offs = torch.tensor([-1, 0, 700, -1, 700, 2048, 2976, -1, 96], dtype=torch.int64, device=DEVICE)
    got, want = backend(name, dtype).dora_scale(y.clone(), storage, offs), backend("torch", dtype).dora_scale(
        y.clone(), storage, offs)
    close(got, want, dtype)
    flat = storage.view(-1)
    for t in range(9):
        o = int(offs[t])
        expect = y[t] if o < 0 else torch.addcmul(y[t], y[t], flat[o:o + 96])
        assert torch.equal(got[t], expect) or o >= 0, "a row without an adapter is left alone"
        close(got[t], expect, dtype)


@pytest.mark.parametrize("name", overriding("rope"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(name, dtype):
    qk = randn(9, 6, 32, dtype=dtype, seed=4)
    cos, sin = randn(9, 32, dtype=dtype, seed=5), randn(9, 32, dtype=dtype, seed=6)
    close(backend(name, dtype).rope(qk.clone(), cos, sin), backend("torch", dtype).rope(qk.clone(), cos, sin), dtype)


@pytest.mark.parametrize("name", overriding("argmax"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(name, dtype):
    logits = randn(5, 1000, dtype=dtype, seed=7)
    assert torch.equal(backend(name, dtype).argmax(logits), backend("torch", dtype).argmax(logits))


@pytest.mark.parametrize("name", overriding("mask_logits_"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 1024, 49155])
def test_mask_logits(name, dtype, vocab):
    """Exact: the masked rows' disallowed tokens are -inf, everything else as it was."""
    seeded = torch.Generator().manual_seed(8)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32, generator=seeded)
    mask[1], mask[4] = -1, 0                                      # every token allowed; none
    logits = randn(6, vocab, dtype=dtype, seed=9)
    rows = [0, 1, 3, 4]
    want = backend("torch", dtype).mask_logits_(logits.clone(), mask, rows)
    assert torch.equal(backend(name, dtype).mask_logits_(logits.clone(), mask, rows), want)
    assert want[4].isneginf().all() and torch.equal(want[[1, 2, 5]], logits[[1, 2, 5]])


def test_the_reference_mask_is_xgrammars():
    """The reference's bit order is xgrammar's (apply_token_bitmask_inplace), whose matchers fill the mask."""
    xgr = pytest.importorskip("xgrammar")
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    logits = randn(3, 1020, dtype=torch.float32, seed=2)
    want = logits.clone().cpu()
    xgr.apply_token_bitmask_inplace(want, mask, vocab_size=1020, indices=[0, 2])
    got = backend("torch", torch.float32).mask_logits_(logits.clone(), mask, [0, 2])
    assert torch.equal(got.cpu(), want)


def test_every_backend_here_implements_something_of_its_own():
    """The selection above leaves no backend without a comparison."""
    assert overriding("linear", "rms_norm", "silu_mul", "rope", "attention", "lora_step") == BACKENDS


def make_meta(seqs, tables, bs, b) -> AttentionMetadata:
    """seqs: (computed tokens, new tokens) per request, decodes (1 new token) first; tables: their pages;
    b: the backend (its every_token_a_row and query_tile_rows)."""
    builder = MetadataBuilder(bs, b.every_token_a_row, b.query_tile_rows)
    for (start, n), table in zip(seqs, tables):
        builder.add(table, start, n)
    meta = builder.build()
    meta.to(DEVICE)
    return meta


def run_attention(b, dtype, steps, tables, bs=16, pages=24, layers=2, window=0, softcap=0.0):
    """Write each step's K/V through the backend and attend: the outputs of every step of layer 1."""
    s = SHAPE
    storage = torch.zeros(pages, layers * 2 * bs * s.num_kv_heads * s.head_dim, dtype=dtype, device=DEVICE)
    k_cache, v_cache = b.kv_caches(storage, layers, bs, s.num_kv_heads, s.head_dim)[1]
    outs = []
    for i, seqs in enumerate(steps):
        t = sum(n for _, n in seqs)
        q = randn(t, s.num_heads, s.head_dim, dtype=dtype, seed=10 * i)
        k = randn(t, s.num_kv_heads, s.head_dim, dtype=dtype, seed=10 * i + 1)
        v = randn(t, s.num_kv_heads, s.head_dim, dtype=dtype, seed=10 * i + 2)
        meta = make_meta(seqs, tables, bs, b)
        b.write_kv(k_cache, v_cache, k, v, meta)
        outs.append(b.attention(q, k_cache, v_cache, meta, s.head_dim ** -0.5, window, softcap))
    return outs


TABLES = [[5, 17, 2], [9, 0, 21, 3], [12, 7, 19]]
STEPS = [[(0, 20), (0, 33), (0, 9)], [(20, 1), (33, 1), (9, 14)], [(21, 1), (34, 1), (23, 1)]]


def like_the_reference(name, dtype, **kw):
    """Three requests over scattered pages: whole prompts, then a decode, a decode and a prompt's second
    chunk in one step, then decodes; every step's output as the reference backend's."""
    for got, want in zip(run_attention(backend(name, dtype), dtype, STEPS, TABLES, **kw),
                         run_attention(backend("torch", dtype), dtype, STEPS, TABLES, **kw)):
        close(got, want, dtype)


@pytest.mark.parametrize("name", overriding("write_kv", "attention", "kv_caches"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_and_attention_over_chunked_prefill_and_decode(name, dtype):
    like_the_reference(name, dtype)


@pytest.mark.parametrize("name", overriding("write_kv", "attention", "kv_caches"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window_attention_over_chunked_prefill_and_decode(name, dtype, window):
    """A sliding window inside one block, of one block, and wider than some contexts."""
    like_the_reference(name, dtype, window=window)


@pytest.mark.parametrize("name", overriding("write_kv", "attention", "kv_caches"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 7])
def test_soft_capped_attention_over_chunked_prefill_and_decode(name, dtype, window):
    """Gemma 2's score soft-cap (a cap of 0.5 bites on these scores), alone and with a window."""
    like_the_reference(name, dtype, window=window, softcap=0.5)


def one_request(n: int):
    """The reference backend, one layer's caches and random q, k, v of n tokens of one request."""
    s = SHAPE
    b = backend("torch", torch.float32)
    storage = torch.zeros(8, 2 * 2 * 16 * s.num_kv_heads * s.head_dim, device=DEVICE)
    k_cache, v_cache = b.kv_caches(storage, 2, 16, s.num_kv_heads, s.head_dim)[0]
    q, k, v = (randn(n, h, s.head_dim, dtype=torch.float32, seed=i)
               for i, h in enumerate((s.num_heads, s.num_kv_heads, s.num_kv_heads)))
    return b, k_cache, v_cache, q, k, v


def dense(q, k, v, i, keys, scale, cap=0.0) -> torch.Tensor:
    """Row i's attention written out over `keys`: [heads, d]."""
    group = SHAPE.num_heads // SHAPE.num_kv_heads
    out = []
    for h in range(SHAPE.num_heads):
        raw = k[keys, h // group].cpu() @ q[i, h].cpu() * scale
        out.append((torch.tanh(raw / cap) * cap if cap else raw).softmax(0) @ v[keys, h // group].cpu())
    return torch.stack(out)


def test_the_reference_soft_cap_is_tanh_of_the_scores():
    """The oracle itself: a capped prompt of 9 against softmax(cap * tanh(s / cap)) written out."""
    b, k_cache, v_cache, q, k, v = one_request(9)
    meta = make_meta([(0, 9)], [[2]], 16, b)
    b.write_kv(k_cache, v_cache, k, v, meta)
    got = b.attention(q, k_cache, v_cache, meta, 0.25, 0, 0.5).cpu()
    for i in (0, 4, 8):
        torch.testing.assert_close(got[i], dense(q, k, v, i, torch.arange(i + 1), 0.25, 0.5), atol=1e-5, rtol=1e-5)


def test_the_reference_window_is_a_dense_softmax_over_the_last_keys():
    """The oracle itself: one request's prompt of 30 then a decode, against softmax over keys (i - w, i]."""
    w = 6
    b, k_cache, v_cache, q, k, v = one_request(31)
    got = []
    for start, n in ((0, 30), (30, 1)):
        meta = make_meta([(start, n)], [[3, 1]], 16, b)
        b.write_kv(k_cache, v_cache, k[start:start + n], v[start:start + n], meta)
        got.append(b.attention(q[start:start + n], k_cache, v_cache, meta, 0.25, w))
    got = torch.cat(got).cpu()
    for i in (0, 3, 5, 6, 17, 30):
        keys = torch.arange(max(0, i - w + 1), i + 1)
        torch.testing.assert_close(got[i], dense(q, k, v, i, keys, 0.25), atol=1e-5, rtol=1e-5)


GROUP_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}


def random_adapter(rank, modules, seed, dtype, packer, page):
    """An adapter over SHAPE's projections as `packer` (the backend's) lays it out: (PackedLayout, its flat
    pages' contents), what the adapter loader writes."""
    s = SHAPE
    dims = {"q_proj": (s.hidden_size, s.q_size), "k_proj": (s.hidden_size, s.kv_size),
            "v_proj": (s.hidden_size, s.kv_size), "o_proj": (s.q_size, s.hidden_size),
            "gate_proj": (s.hidden_size, s.intermediate_size), "up_proj": (s.hidden_size, s.intermediate_size),
            "down_proj": (s.intermediate_size, s.hidden_size)}
    shapes = {(layer, m): (rank, *dims[m], 2.0 / rank) for layer in range(s.num_layers) for m in sorted(modules)}
    layout = packer.plan(shapes, page)
    flat = torch.zeros(layout.num_pages(page) * page, dtype=dtype)
    for i, (key, (r, n_in, n_out, _)) in enumerate(sorted(shapes.items())):
        a = randn(r, n_in, dtype=dtype, seed=seed * 1000 + 2 * i, scale=0.2)
        b = randn(n_out, r, dtype=dtype, seed=seed * 1000 + 2 * i + 1, scale=0.2)
        packer.place(layout, key, a, b, flat)
    return layout, flat


@pytest.mark.parametrize("name", overriding("lora_step"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", ["decode-distinct", "mixed", "one-adapter", "base-only"])
def test_lora_step_projects_like_the_reference(name, dtype, spread):
    """Adapters of ranks 1 to 64 (odd ones too) with different targets, each spanning several pages that are
    neither contiguous nor in order, spread over decode tokens and prefill chunks next to base tokens; each
    group's projection plus its deltas."""
    adapters = {1: (4, ALL), 2: (16, ("q_proj", "v_proj")), 3: (1, ("down_proj", "o_proj")),
                4: (7, ("gate_proj", "up_proj", "k_proj")), 5: (64, ("q_proj", "down_proj")), 6: (33, ALL)}
    token_adapters = {"decode-distinct": [1, 2, 3, 4, 0, 2, 5, 6],
                      "mixed": [3, 0, 1, 4, 6, 5] + [2] * 9 + [0] * 3 + [1] * 17 + [4] * 2 + [6] * 5 + [5] * 3,
                      "one-adapter": [2] * 12, "base-only": [0] * 5}[spread]
    num_decode = {"decode-distinct": 8, "mixed": 6}.get(spread, 0)
    results = []
    for b in (backend(name, dtype), backend("torch", dtype)):
        # NOTE: the CPU backend keeps each (layer, group) block inside a page: larger pages there
        page, num_pages = (PAGE, 1200) if b.name != "cpu" else (1 << 15, 120)
        storage = torch.zeros(num_pages, page, dtype=dtype, device=DEVICE)
        slots = b.lora_slots(6, 64, b.shape, storage)
        free = list(range(num_pages - 1, 0, -3))                 # pages out of order, not contiguous
        for aid, (rank, mods) in adapters.items():
            layout, flat = random_adapter(rank, mods, aid, dtype, b.lora_packer(), page)
            n = layout.num_pages(page)
            pages, free = free[:n], free[n:]
            storage[pages] = flat.view(n, page).to(DEVICE)
            slots.assign(aid, layout, pages, busy=set())
        token_slots = [slots.slot_of[a] if a else -1 for a in token_adapters]
        step = b.lora_step(slots, token_slots, num_decode)
        assert (step is None) == (spread == "base-only")
        outs = []
        for group, (n_in, n_out) in {"qkv": (128, 128 + 2 * 64), "o": (128, 128), "gate_up": (128, 384),
                                     "down": (192, 128)}.items():
            lin = b.linear(randn(n_out, n_in, dtype=dtype, seed=50, scale=0.1))
            x = randn(len(token_slots), n_in, dtype=dtype, seed=51)
            outs.append(lin(x) if step is None else step.project(lin, 1, group, x))
        results.append(outs)
    for got, want in zip(*results):
        close(got, want, dtype)


ALL = tuple(m for mods in GROUP_MODULES.values() for m in mods)
PAGE = 1000    # elements per page: an adapter module spans several pages
