"""What attention needs to know of one step, shared by every layer (built by engine/model_runner.py).

A request's K/V for token t lives at page block_table[t // block_size], offset t % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    """One request computing more than one token: queries [q_start, q_end) of the step's tokens,
    attending to its first `ctx_len` tokens (the new ones included), through `block_table`."""
    q_start: int
    q_end: int
    ctx_len: int
    block_table: torch.Tensor   # [num_blocks] int64
    mask: torch.Tensor | None   # [q_len, ctx_len] bool, None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    """The first `num_decode` tokens are single query rows, each over its own prefix (decode tokens; on a
    backend whose `every_token_a_row` is True, every token of the step); the rest belong to `prefills`.
    A backend whose `query_tile_rows` is > 0 gets those rows as `query_tiles` over `seq_block_tables`
    (decode_block_tables / decode_lens stay None)."""
    slot_page: torch.Tensor         # [T] int64 page of each new token's K/V
    slot_offset: torch.Tensor       # [T] int64 offset inside that page
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64 block table of each row (padded with page 0)
    decode_lens: torch.Tensor | None          # [D] int64 how many tokens each row attends to
    prefills: list[PrefillSeq]
    decode_mask: torch.Tensor | None = None   # [D, 1, 1, max_blocks * block_size] additive: a backend's cache
                                              # (the reference backend builds it on the first layer)
    seq_block_tables: torch.Tensor | None = None  # [S, max_blocks] int32 each request's pages (padded with 0)
    query_tiles: torch.Tensor | None = None       # [N, 4] int32 (request, first row, rows, first row's length)
    max_tile_rows: int = 0                        # the most rows of any tile


def query_tiles(first_row: int, seq: int, start: int, n: int, tile_rows: int) -> list[tuple[int, int, int, int]]:
    """The tiles of request `seq` computing its tokens [start, start + n) as rows first_row .. first_row+n-1:
    (seq, first row, rows, first row's length), at most `tile_rows` rows each (a decode token: one tile)."""
    return [(seq, first_row + lo, min(tile_rows, n - lo), start + lo + 1) for lo in range(0, n, tile_rows)]
