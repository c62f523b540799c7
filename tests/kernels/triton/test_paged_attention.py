"""Triton paged attention (TRITON_INTERPRET=1 on CPU; on the GPU under `make gpu-check`) against the fp32
torch reference, one row at a time."""
from __future__ import annotations

import pytest
import torch

from kernels.triton.paged_attention import num_splits, paged_attention, tile_rows
from tests.kernels.backends import on_device
from tests.kernels.cpu.test_attention import make_cache, random_rows, reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_step(dtype, heads, kv_heads, d, bs, chunks, rows_per_tile, num_pages=96, seed=0):
    """-> (the kernel's arguments, the reference's arguments) for a step of these chunks (random_rows)."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = make_cache(num_pages, 3, bs, kv_heads, d, dtype, layer=1, seed=seed)
    q, tables, tiles, max_rows, row_tables, row_lens = random_rows(chunks, heads, d, bs, dtype, rows_per_tile,
                                                                   num_pages, g)
    return (q, k_cache, v_cache, tables, tiles, max_rows), (q, k_cache, v_cache, row_tables, row_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16), (6, 3, 48, 12)])
def test_a_mixed_step_matches_reference(dtype, heads, kv_heads, d, bs):
    """Decode tokens (one, a partial block, exact blocks, a long tail) and prefill chunks (a whole prompt,
    a later chunk, one longer than a tile) in one launch; head_dim 48 and block_size 12 included."""
    chunks = [(0, 1), (4, 1), (bs - 1, 1), (3 * bs + 6, 1), (0, 23), (2 * bs + 3, 9), (5, 1)]
    args, ref_args = random_step(dtype, heads, kv_heads, d, bs, chunks, rows_per_tile=8)
    out, _ = on_device(paged_attention, *args, d ** -0.5)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.float(), reference(*ref_args, d ** -0.5), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("rows_per_tile", [1, 3, 16])
def test_any_tiling_of_the_rows_gives_the_same_result(rows_per_tile):
    """A prefill chunk cut into tiles of any size: each row still attends to exactly its own prefix."""
    args, ref_args = random_step(torch.float32, 9, 3, 64, 16, [(30, 40), (0, 1)], rows_per_tile)
    out, _ = on_device(paged_attention, *args, 0.125)
    torch.testing.assert_close(out, reference(*ref_args, 0.125), atol=1e-5, rtol=1e-5)


def test_padding_past_a_request_is_never_read():
    """Table entries and pages past a request's length hold other data (here NaN): they must not count."""
    args, ref_args = random_step(torch.float32, 4, 2, 32, 8, [(10, 6), (3, 1)], rows_per_tile=4)
    q, k_cache, v_cache, tables, tiles, max_rows = args
    used = {int(p) for s, n in ((0, 16), (1, 4)) for p in tables[s, : -(-n // 8)]}
    for page in set(range(k_cache.shape[0])) - used:
        k_cache[page] = float("nan")
        v_cache[page] = float("nan")
    out, _ = on_device(paged_attention, q, k_cache, v_cache, tables, tiles, max_rows, 0.2)
    assert out.isfinite().all()
    torch.testing.assert_close(out, reference(*ref_args, 0.2), atol=1e-5, rtol=1e-5)


def test_tile_rows_fill_a_program():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert tile_rows(9, 3, 64, bf16) == 16 and tile_rows(32, 8, 128, bf16) == 16 and tile_rows(8, 1, 64, bf16) == 8
    assert tile_rows(64, 1, 64, bf16) == 1 and tile_rows(9, 3, 64, fp32) == 16 and tile_rows(32, 8, 128, fp32) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_keys", [32, 40])
def test_split_keys_merged_match_reference(dtype, split_keys):
    """A step with few programs splits each row's keys into ranges (one program each, merged by a second
    kernel): decodes shorter than one split, on a boundary and across several; a chunk whose rows cross a
    boundary; ranges that are and are not a multiple of the key step."""
    chunks = [(2, 1), (79, 1), (130, 1), (35, 12), (0, 5)]
    args, ref_args = random_step(dtype, 9, 3, 64, 16, chunks, rows_per_tile=8)
    max_len = max(s + n for s, n in chunks)
    out, _ = on_device(paged_attention, *args, 0.125, max_len, split_keys)
    torch.testing.assert_close(out.float(), reference(*ref_args, 0.125), atol=TOL[dtype], rtol=TOL[dtype])


def test_a_step_splits_only_when_it_has_few_programs():
    assert num_splits(1, 3, 8192) == 8 and num_splits(1, 3, 1000) == 1 and num_splits(300, 3, 8192) == 1
