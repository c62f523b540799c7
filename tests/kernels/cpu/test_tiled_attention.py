"""The C tiled paged attention (attention_tiled.c) against the fp32 torch reference, one row at a
time; and the property the engine relies on: a token's output has the same bits in any tile."""
from __future__ import annotations

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata, query_tiles
from kernels.cpu import attention as cpu_attention
from kernels.reference import attention as torch_attention
from tests.kernels.cpu.test_attention import make_cache, random_rows, reference

pytestmark = pytest.mark.skipif(not cpu_attention.tiled_supports(torch.float32, 8, 64), reason="no C compiler here")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_step(dtype, heads, kv_heads, d, bs, chunks, rows_per_tile, num_pages=96, seed=0):
    """-> (the kernel's arguments over keys_last_views of a pool of random K/V, the reference's arguments in
    the row layout) for a step of these chunks (random_rows)."""
    g = torch.Generator().manual_seed(seed)
    k_rows, v_rows = make_cache(num_pages, 1, bs, kv_heads, d, dtype, layer=0, seed=seed)
    storage = torch.zeros(num_pages, 2 * bs * kv_heads * d, dtype=dtype)
    k_cache, v_cache = cpu_attention.keys_last_views(storage, 1, bs, kv_heads, d)[0]
    k_cache.copy_(k_rows.permute(0, 2, 3, 1))
    v_cache.copy_(v_rows)
    q, tables, tiles, _, row_tables, row_lens = random_rows(chunks, heads, d, bs, dtype, rows_per_tile, num_pages, g)
    return (q, k_cache, v_cache, tables, tiles), (q, k_rows, v_rows, row_tables, row_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 32), (4, 4, 32, 8), (8, 1, 128, 16), (6, 3, 48, 12),
                                                 (4, 2, 40, 16)])
def test_a_mixed_step_matches_reference(dtype, heads, kv_heads, d, bs):
    """Decodes (one token, a partial block, exact blocks, a long tail) and prefill chunks (a whole prompt, a
    later chunk, one longer than a tile) in one call; head_dim 40 takes the unblocked loops."""
    chunks = [(0, 1), (4, 1), (bs - 1, 1), (3 * bs + 6, 1), (0, 23), (2 * bs + 3, 9), (5, 1)]
    args, ref_args = random_step(dtype, heads, kv_heads, d, bs, chunks, rows_per_tile=8)
    out = cpu_attention.tiled_attention(*args, d ** -0.5)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.float(), reference(*ref_args, d ** -0.5), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_split_across_tasks_match_reference(dtype):
    """Rows longer than SPLIT_KEYS take their keys in several tasks, merged: decodes at 1,300 and 1,024
    (an exact split boundary), a chunk whose rows cross one."""
    keys = cpu_attention.SPLIT_KEYS
    chunks = [(1300, 1), (2 * keys - 1, 1), (keys - 7, 12), (3, 1)]
    args, ref_args = random_step(dtype, 9, 3, 64, 16, chunks, rows_per_tile=8, num_pages=400)
    out = cpu_attention.tiled_attention(*args, 0.125)
    torch.testing.assert_close(out.float(), reference(*ref_args, 0.125), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,start", [(64, 13), (40, 13), (64, cpu_attention.SPLIT_KEYS - 9)])
def test_a_token_gets_the_same_bits_whatever_shares_its_tile(dtype, d, start):
    """A prefill chunk in tiles of 8, of 3, and every row alone (as decode tokens are): bit-identical, so a
    request recomputed after preemption or a restart sees the K/V and outputs it saw before; also when
    the chunk's rows cross a split of the keys."""
    chunks = [(start, 20)]
    outs = []
    for rows in (8, 3, 1):
        args, _ = random_step(dtype, 9, 3, d, 16, chunks, rows_per_tile=rows)
        outs.append(cpu_attention.tiled_attention(*args, 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_pages_past_a_request_are_never_read():
    """Pages other than the requests' hold NaN: they must not count."""
    args, ref_args = random_step(torch.float32, 4, 2, 32, 8, [(10, 6), (3, 1)], rows_per_tile=4)
    q, k_cache, v_cache, tables, tiles = args
    used = {int(p) for s, n in ((0, 16), (1, 4)) for p in tables[s, : -(-n // 8)]}
    for page in set(range(k_cache.shape[0])) - used:
        k_cache[page] = float("nan")
        v_cache[page] = float("nan")
    out = cpu_attention.tiled_attention(q, k_cache, v_cache, tables, tiles, 0.2)
    torch.testing.assert_close(out, reference(*ref_args, 0.2), atol=1e-5, rtol=1e-5)


def test_writes_land_where_the_kernel_reads_them():
    """write_kv_keys_last then the kernel equals the reference backend's write + SDPA in the row layout."""
    kvh, d, bs, pages = 2, 32, 8, 6
    storage = torch.zeros(pages, 2 * bs * kvh * d)
    k_cache, v_cache = cpu_attention.keys_last_views(storage, 1, bs, kvh, d)[0]
    k_rows, v_rows = torch.zeros(pages, bs, kvh, d), torch.zeros(pages, bs, kvh, d)
    table, n = [4, 1], 11
    k, v, q = torch.randn(n, kvh, d), torch.randn(n, kvh, d), torch.randn(n, 4, d)
    slot_page = torch.tensor([table[t // bs] for t in range(n)])
    slot_offset = torch.tensor([t % bs for t in range(n)])
    cpu_attention.write_kv_keys_last(k_cache, v_cache, k, v, slot_page, slot_offset)
    meta = AttentionMetadata(slot_page, slot_offset, n, torch.tensor([table] * n), torch.arange(1, n + 1), [])
    torch_attention.write_kv(k_rows, v_rows, k, v, meta)
    out = cpu_attention.tiled_attention(q, k_cache, v_cache, torch.tensor([table], dtype=torch.int32),
                                        torch.tensor(query_tiles(0, 0, 0, n, 8), dtype=torch.int32), 0.3)
    torch.testing.assert_close(out, torch_attention.paged_attention(q, k_rows, v_rows, meta, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_refuses_a_cache_in_the_row_layout():
    args, _ = random_step(torch.float32, 4, 2, 32, 8, [(0, 3)], rows_per_tile=4)
    q, k_cache, v_cache, tables, tiles = args
    with pytest.raises(AssertionError):
        cpu_attention.tiled_attention(q, v_cache, v_cache, tables, tiles, 0.1)


def test_shapes_beyond_the_compiled_limits_fall_back():
    assert cpu_attention.tiled_supports(torch.float32, 9, 64) and cpu_attention.tiled_supports(torch.float32, 128, 256)
    assert not cpu_attention.tiled_supports(torch.float32, 129, 64)
    assert not cpu_attention.tiled_supports(torch.float32, 8, 512)
