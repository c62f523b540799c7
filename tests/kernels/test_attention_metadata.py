"""How the model runner cuts a request's rows into attention tiles."""
from __future__ import annotations

from kernels.attention_metadata import MetadataBuilder, query_tiles


def test_a_decode_token_is_one_tile_of_one_row():
    assert query_tiles(7, 2, 40, 1, 16) == [(2, 7, 1, 41)]


def test_a_prefill_chunk_is_cut_into_tiles_that_cover_its_rows_once():
    tiles = query_tiles(3, 0, 30, 40, 16)               # tokens 30..69 as rows 3..42
    assert tiles == [(0, 3, 16, 31), (0, 19, 16, 47), (0, 35, 8, 63)]
    rows = [r for _, first, n, _ in tiles for r in range(first, first + n)]
    assert rows == list(range(3, 43))


def build(every_token_a_row: bool, tile_rows: int):
    """Two requests on block size 4: a decode at position 5 (pages 7, 3), then a chunk of 3 tokens at
    positions 2..4 (pages 9, 1)."""
    b = MetadataBuilder(4, every_token_a_row, tile_rows)
    b.add([7, 3, 8], 5, 1)
    b.add([9, 1, 6], 2, 3)
    return b.build()


def test_every_new_token_gets_its_page_and_offset():
    meta = build(False, 0)
    assert meta.slot_page.tolist() == [3, 9, 9, 1] and meta.slot_offset.tolist() == [1, 2, 3, 0]


def test_a_backend_with_prefill_sequences_gets_decode_rows_then_a_masked_chunk():
    meta = build(False, 0)
    assert meta.num_decode == 1 and meta.decode_block_tables.tolist() == [[7, 3]]
    assert meta.decode_lens.tolist() == [6]
    (p,) = meta.prefills
    assert (p.q_start, p.q_end, p.ctx_len, p.block_table.tolist()) == (1, 4, 5, [9, 1])
    assert p.mask.tolist() == [[True] * 3 + [False] * 2, [True] * 4 + [False], [True] * 5]


def test_a_row_backend_gets_every_token_as_a_row_over_its_own_prefix():
    meta = build(True, 0)
    assert not meta.prefills and meta.num_decode == 4
    assert meta.decode_block_tables.tolist() == [[7, 3], [9, 1], [9, 1], [9, 1]]
    assert meta.decode_lens.tolist() == [6, 3, 4, 5]


def test_a_tiling_backend_gets_tiles_over_one_table_per_request():
    meta = build(True, 2)
    assert not meta.prefills and meta.num_decode == 4 and meta.decode_block_tables is None
    assert meta.seq_block_tables.tolist() == [[7, 3], [9, 1]]
    assert meta.query_tiles.tolist() == [[0, 0, 1, 6], [1, 1, 2, 3], [1, 3, 1, 5]]
    assert meta.max_tile_rows == 2 and meta.max_context == 6
