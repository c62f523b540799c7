"""What attention needs to know of one step, shared by every layer (MetadataBuilder, called by
engine/model_runner.py).

A request's K/V for token t lives at page block_table[t // block_size], offset t % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.transfer import to_device


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
    decode_masks: dict = field(default_factory=dict)   # window -> [D, 1, 1, max_blocks * block_size] additive:
                                              # a backend's cache (the reference backend's, built on first use)
    seq_block_tables: torch.Tensor | None = None  # [S, max_blocks] int32 each request's pages (padded with 0)
    query_tiles: torch.Tensor | None = None       # [N, 4] int32 (request, first row, rows, first row's length)
    max_tile_rows: int = 0                        # the most rows of any tile
    max_context: int = 0                          # the longest row's length (tokens attended to)

    def to(self, device: torch.device, *extra: torch.Tensor) -> list[torch.Tensor]:
        """Moves every tensor to `device` in place, together with `extra` host tensors, in one transfer
        (kernels/transfer.py); returns the moved `extra`."""
        names = ("slot_page", "slot_offset", "decode_block_tables", "decode_lens", "seq_block_tables",
                 "query_tiles")
        tensors = [getattr(self, n) for n in names] + [t for p in self.prefills for t in (p.block_table, p.mask)]
        moved = to_device(tensors + list(extra), device)
        for name, t in zip(names, moved):
            setattr(self, name, t)
        for i, p in enumerate(self.prefills):
            p.block_table, p.mask = moved[len(names) + 2 * i], moved[len(names) + 2 * i + 1]
        self.decode_masks = {}
        return moved[len(tensors):]


class MetadataBuilder:
    """A step's AttentionMetadata, built on the host as the backend lays it out: add the requests in row
    order, then build(). A request whose chunk is one token (decode), or any request on a backend that
    takes every token as a row, becomes rows (`decode_*`, or `query_tiles` when `tile_rows` > 0); any
    other becomes a PrefillSeq."""

    def __init__(self, block_size: int, every_token_a_row: bool, tile_rows: int):
        self.block_size, self.every_token_a_row, self.tile_rows = block_size, every_token_a_row, tile_rows
        self.pages: list[int] = []
        self.offsets: list[int] = []
        self.tables: list[list[int]] = []      # one per request given rows
        self.counts: list[int] = []            # its number of rows
        self.lens: list[int] = []              # each row's length (no tiles)
        self.tiles: list[tuple[int, int, int, int]] = []
        self.prefills: list[PrefillSeq] = []

    def add(self, block_ids: list[int], start: int, n: int) -> None:
        """A request computing its tokens [start, start + n) with pages `block_ids` (at least enough)."""
        bs, q_start, end = self.block_size, len(self.pages), start + n
        self.pages.extend(block_ids[p // bs] for p in range(start, end))
        self.offsets.extend(p % bs for p in range(start, end))
        table = block_ids[: -(-end // bs)]
        if self.tile_rows:
            self.tiles += query_tiles(q_start, len(self.tables), start, n, self.tile_rows)
        elif n > 1 and not self.every_token_a_row:
            self.prefills.append(PrefillSeq(q_start, q_start + n, end, torch.tensor(table), chunk_mask(start, n)))
            return
        else:
            self.lens.extend(range(start + 1, end + 1))
        self.tables.append(table)
        self.counts.append(n)

    def build(self) -> AttentionMetadata:
        meta = AttentionMetadata(torch.tensor(self.pages, dtype=torch.long),
                                 torch.tensor(self.offsets, dtype=torch.long), sum(self.counts), None, None,
                                 self.prefills)
        if self.tiles:
            meta.seq_block_tables = _padded(self.tables, torch.int32)
            meta.query_tiles = torch.tensor(self.tiles, dtype=torch.int32)
            meta.max_tile_rows = max(t[2] for t in self.tiles)
            meta.max_context = max(t[2] + t[3] - 1 for t in self.tiles)
        elif self.tables:
            tables = _padded(self.tables, torch.int64)
            counts = torch.tensor(self.counts)
            meta.decode_block_tables = tables if bool((counts == 1).all()) else tables.repeat_interleave(counts, 0)
            meta.decode_lens = torch.tensor(self.lens, dtype=torch.long)
        return meta


def _padded(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Block tables as one [len(tables), longest] tensor, padded with page 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


def chunk_mask(start: int, n: int) -> torch.Tensor | None:
    """Queries at positions [start, start+n) over keys [0, start+n): key j visible to query i iff
    j <= start + i. None when start == 0 (plain causal)."""
    if start == 0:
        return None
    q = torch.arange(start, start + n)[:, None]
    k = torch.arange(start + n)[None, :]
    return k <= q


def query_tiles(first_row: int, seq: int, start: int, n: int, tile_rows: int) -> list[tuple[int, int, int, int]]:
    """The tiles of request `seq` computing its tokens [start, start + n) as rows first_row .. first_row+n-1:
    (seq, first row, rows, first row's length), at most `tile_rows` rows each (a decode token: one tile)."""
    return [(seq, first_row + lo, min(tile_rows, n - lo), start + lo + 1) for lo in range(0, n, tile_rows)]
