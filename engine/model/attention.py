"""Attention over the paged KV cache: C kernels on CPU, else SDPA over gathered blocks.

A request's K/V for token t lives at page block_table[t // block_size], offset t % block_size. The cache
of one layer is a view `[num_pages, block_size, kv_heads, head_dim]` of the page pool (row layout), or,
for bf16 with AVX512-BF16, the paired views of `kernels.cpu.attention.paired_views` (meta.paired).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import attention as cpu_attention


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
    """Per step; shared by every layer. The first `num_decode` tokens are single query rows, each over
    its own prefix (decode tokens; with the C kernel, every token of the step); the rest belong to
    `prefills` (the torch path)."""
    slot_page: torch.Tensor         # [T] page of each new token's K/V
    slot_offset: torch.Tensor       # [T] offset inside that page
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] block table of each row (padded with page 0)
    decode_lens: torch.Tensor | None          # [D] int64 how many tokens each row attends to
    decode_mask: torch.Tensor | None          # [D, 1, 1, max_blocks * block_size] additive, model dtype;
                                              # only for the torch path (None when the C kernel runs)
    prefills: list[PrefillSeq]
    paired: bool = False                      # the caches are kernels.cpu.attention.paired_views (bf16):
                                              # every token is a decode row, read by paired_attention


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v: [T, kv_heads, head_dim] -> the cache slots of the step's tokens."""
    if meta.paired:
        cpu_attention.write_kv_paired(k_cache, v_cache, k, v, meta.slot_page, meta.slot_offset)
        return
    k_cache[meta.slot_page, meta.slot_offset] = k
    v_cache[meta.slot_page, meta.slot_offset] = v


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[B, nb] block table -> [B, kv_heads, nb * block_size, head_dim] (a copy)."""
    b, nb = block_table.shape
    _, bs, kvh, d = cache.shape
    # NOTE: index_select is several times faster than advanced indexing on a strided view.
    x = torch.index_select(cache, 0, block_table.flatten())     # [B * nb, bs, kvh, d]
    return x.view(b, nb * bs, kvh, d).transpose(1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> out: [T, heads, head_dim]."""
    if meta.paired:
        assert not meta.prefills and meta.num_decode == q.shape[0], "the paired layout takes every token as a decode row"
        return cpu_attention.paired_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale)
    out = torch.empty_like(q)
    d = meta.num_decode
    if d and meta.decode_mask is None:
        out[:d] = cpu_attention.decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_lens, scale)
    elif d:
        kvh, head_dim = k_cache.shape[-2:]
        # The query heads sharing a KV head act as that head's "query rows": [D, kvh, group, d].
        qd = q[:d].view(d, kvh, -1, head_dim)
        k = _gather(k_cache, meta.decode_block_tables)          # [D, kvh, L, d]
        v = _gather(v_cache, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:d] = o.reshape(d, -1, head_dim)
    for p in meta.prefills:
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)          # [1, heads, n, d]
        k = _gather(k_cache, p.block_table[None])[:, :, : p.ctx_len]    # [1, kvh, ctx, d]
        v = _gather(v_cache, p.block_table[None])[:, :, : p.ctx_len]
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=scale, enable_gqa=True)
        out[p.q_start:p.q_end] = o.squeeze(0).transpose(0, 1)
    return out
