"""The paired KV layout (attention_avx512bf16.c): its writer against the layout's definition, its attention
against the fp32 reference and against the row-layout kernel."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.cpu import attention as cpu_attention
from kernels.cpu.backend import CpuBackend
from kernels.reference.backend import TorchBackend
from tests.engine.lora.synthetic import TINY
from tests.kernels.cpu.test_attention import reference

pytestmark = pytest.mark.skipif(not cpu_attention.paired_supported(torch.bfloat16, 64, 16),
                                reason="needs a C compiler and AVX512-BF16")


def paired_case(heads, kv_heads, d, bs, lens, num_pages=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    storage = torch.randn(num_pages, 3 * 2 * bs * kv_heads * d, generator=g).bfloat16()
    k_cache, v_cache = cpu_attention.paired_views(storage, 3, bs, kv_heads, d)[1]
    lens = torch.tensor(lens)
    width = int(-(-lens.max() // bs))
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, d, generator=g).bfloat16()
    return q, k_cache, v_cache, tables, lens


def test_views_follow_the_documented_layout():
    """K block [kv_heads, d/2, bs, 2], V block [kv_heads, bs/2, d, 2], one layer's K then V in a page."""
    bs, kvh, d = 16, 2, 32
    storage = torch.arange(4 * 2 * 2 * bs * kvh * d, dtype=torch.float32).bfloat16().view(4, -1)
    k, v = cpu_attention.paired_views(storage, 2, bs, kvh, d)[1]
    block = bs * kvh * d
    page, h, t, i = 3, 1, 5, 7
    base = page * storage.shape[1] + 2 * block          # layer 1, K
    assert k[page, h, i // 2, t, i % 2] == storage.view(-1)[base + ((h * d // 2 + i // 2) * bs + t) * 2 + i % 2]
    base += block                                       # layer 1, V
    assert v[page, h, t // 2, i, t % 2] == storage.view(-1)[base + ((h * bs // 2 + t // 2) * d + i) * 2 + t % 2]


@pytest.mark.parametrize("kvh,d,bs", [(3, 64, 16), (1, 128, 32), (4, 32, 16)])
def test_write_puts_each_token_where_the_layout_says(kvh, d, bs):
    g = torch.Generator().manual_seed(1)
    storage = torch.zeros(20, 2 * 2 * bs * kvh * d, dtype=torch.bfloat16)
    kc, vc = cpu_attention.paired_views(storage, 2, bs, kvh, d)[0]
    n = 100                                             # more than 64 rows: the parallel path
    qkv = torch.randn(n, (2 + 2 * kvh) * d, generator=g).bfloat16()   # k, v as views of a fused row
    k, v = qkv[:, 2 * d:(2 + kvh) * d].view(n, kvh, d), qkv[:, (2 + kvh) * d:].view(n, kvh, d)
    slots = torch.randperm(20 * bs, generator=g)[:n]
    pages, offs = slots // bs, slots % bs
    cpu_attention.write_kv_paired(kc, vc, k, v, pages, offs)
    for j in range(n):
        p, t = int(pages[j]), int(offs[j])
        assert torch.equal(kc[p, :, :, t, :].reshape(kvh, d), k[j])
        assert torch.equal(vc[p, :, t // 2, :, t % 2], v[j])
    assert int((storage != 0).sum()) == int((k != 0).sum() + (v != 0).sum())   # nothing else written


@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (8, 1, 128, 32), (4, 4, 32, 16), (14, 2, 64, 16),
                                                 (24, 4, 96, 16)])
def test_matches_fp32_reference(heads, kv_heads, d, bs):
    lens = [1, 2, bs, bs + 1, 3 * bs - 1, 100, 7, 33, 64, 5]   # more rows than threads: next-row prefetching
    q, kc, vc, tables, lens_t = paired_case(heads, kv_heads, d, bs, lens)
    out = cpu_attention.paired_attention(q, kc, vc, tables, lens_t, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    k_rows, v_rows = cpu_attention.unpair(kc, vc)
    ref = reference(q, k_rows, v_rows, tables, lens_t, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_slots_past_each_length_never_count():
    """The partner of an odd last token and everything after it may hold anything, NaN included."""
    bs = 16
    q, kc, vc, tables, lens = paired_case(9, 3, 64, bs, [5, 21])
    out = cpu_attention.paired_attention(q, kc, vc, tables, lens, 0.125)
    for row, n in enumerate(lens.tolist()):
        last = int(tables[row, (n - 1) // bs])
        t = n % bs                                       # the first slot past the end, same block
        kc[last, :, :, t:] = float("nan")
        vc[last, :, t // 2, :, 1] = float("nan")          # the odd token's partner slot
        vc[last, :, t // 2 + 1:] = float("nan")
    again = cpu_attention.paired_attention(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out, again, atol=0, rtol=0)


def test_query_rows_at_a_stride():
    """q as the engine passes it, a view of the fused qkv rows: the same as a contiguous q."""
    q, kc, vc, tables, lens = paired_case(9, 3, 64, 16, [5, 21, 40])
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 3 * 64).to(q.dtype)], dim=1)
    view = qkv[:, : 9 * 64].view(-1, 9, 64)
    assert not view.is_contiguous()
    torch.testing.assert_close(cpu_attention.paired_attention(view, kc, vc, tables, lens, 0.125),
                               cpu_attention.paired_attention(q, kc, vc, tables, lens, 0.125), atol=0, rtol=0)


def test_backend_path_agrees_with_the_row_layout():
    """The CPU backend's write_kv + attention over its paired views give what the reference backend gives
    over the row layout."""
    bs, kvh, d, h, pages = 16, 3, 64, 9, 30
    g = torch.Generator().manual_seed(3)
    lens = [3, 17, 64, 40]
    n = sum(lens)
    k = torch.randn(n, kvh, d, generator=g).bfloat16()
    v = torch.randn(n, kvh, d, generator=g).bfloat16()
    q = torch.randn(len(lens), h, d, generator=g).bfloat16()
    perm = torch.randperm(pages, generator=g)
    width = -(-max(lens) // bs)
    tables = perm[: len(lens) * width].view(len(lens), width)
    seq = torch.cat([torch.full((m,), i) for i, m in enumerate(lens)])
    pos = torch.cat([torch.arange(m) for m in lens])
    slot_page, slot_off = tables[seq, pos // bs], pos % bs
    shape = dataclasses.replace(TINY, dtype=torch.bfloat16, num_heads=h, num_kv_heads=kvh, head_dim=d)
    outs = []
    for backend in (CpuBackend(shape), TorchBackend(shape)):
        storage = torch.zeros(pages, 2 * bs * kvh * d, dtype=torch.bfloat16)
        caches = backend.kv_caches(storage, 1, bs, kvh, d)[0]
        assert caches[0].dim() == (5 if backend.name == "cpu" else 4)     # paired / rows
        # every token a row for the C kernel; the reference backend takes only the queries here
        meta = AttentionMetadata(slot_page, slot_off, len(lens), tables, torch.tensor(lens), [])
        backend.write_kv(*caches, k, v, meta)
        outs.append(backend.attention(q, *caches, meta, 0.125))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


def test_refuses_row_layout_views():
    q, kc, vc, tables, lens = paired_case(9, 3, 64, 16, [3])
    k_rows, v_rows = cpu_attention.unpair(kc, vc)
    with pytest.raises(AssertionError, match="paired"):
        cpu_attention.paired_attention(q, k_rows, v_rows, tables, lens, 0.1)


def test_layout_needs_bf16_and_whole_tiles():
    assert not cpu_attention.paired_supported(torch.float32, 64, 16)
    assert not cpu_attention.paired_supported(torch.bfloat16, 48, 16)
    assert not cpu_attention.paired_supported(torch.bfloat16, 64, 8)
