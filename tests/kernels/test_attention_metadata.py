"""How the model runner cuts a request's rows into attention tiles."""
from __future__ import annotations

from kernels.attention_metadata import query_tiles


def test_a_decode_token_is_one_tile_of_one_row():
    assert query_tiles(7, 2, 40, 1, 16) == [(2, 7, 1, 41)]


def test_a_prefill_chunk_is_cut_into_tiles_that_cover_its_rows_once():
    tiles = query_tiles(3, 0, 30, 40, 16)               # tokens 30..69 as rows 3..42
    assert tiles == [(0, 3, 16, 31), (0, 19, 16, 47), (0, 35, 8, 63)]
    rows = [r for _, first, n, _ in tiles for r in range(first, first + n)]
    assert rows == list(range(3, 43))
