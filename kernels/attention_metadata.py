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
    backend whose `every_token_a_row` is True, every token of the step); the rest belong to `prefills`."""
    slot_page: torch.Tensor         # [T] int64 page of each new token's K/V
    slot_offset: torch.Tensor       # [T] int64 offset inside that page
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64 block table of each row (padded with page 0)
    decode_lens: torch.Tensor | None          # [D] int64 how many tokens each row attends to
    prefills: list[PrefillSeq]
    decode_mask: torch.Tensor | None = None   # [D, 1, 1, max_blocks * block_size] additive: a backend's cache
                                              # (the reference backend builds it on the first layer)
