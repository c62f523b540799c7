"""Paged attention in plain torch: SDPA over K/V blocks gathered through the block tables (row layout:
K, V [num_pages, block_size, kv_heads, head_dim])."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v: [T, kv_heads, head_dim] -> the cache slots of the step's tokens."""
    k_cache[meta.slot_page, meta.slot_offset] = k
    v_cache[meta.slot_page, meta.slot_offset] = v


def gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[B, nb] block table -> [B, kv_heads, nb * block_size, head_dim] (a copy)."""
    b, nb = block_table.shape
    _, bs, kvh, d = cache.shape
    # NOTE: index_select is several times faster than advanced indexing on a strided view.
    x = torch.index_select(cache, 0, block_table.flatten())     # [B * nb, bs, kvh, d]
    return x.view(b, nb * bs, kvh, d).transpose(1, 2)


def decode_mask(meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """[D, 1, 1, max_blocks * block_size] additive mask of the decode rows (built once a step per window):
    a row of length L sees keys [0, L), or [L - window, L) with a window."""
    if window not in meta.decode_masks:
        width = meta.decode_block_tables.shape[1] * block_size
        lens = meta.decode_lens                                          # on the step's device
        keys = torch.arange(width, device=lens.device)[None, :]
        visible = keys < lens[:, None]
        if window:
            visible &= keys >= lens[:, None] - window
        mask = torch.zeros(visible.shape, dtype=dtype, device=lens.device).masked_fill_(~visible, float("-inf"))
        meta.decode_masks[window] = mask[:, None, None, :]
    return meta.decode_masks[window]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         softcap: float = 0.0) -> torch.Tensor:
    """SDPA, or with a soft-cap the same in plain ops (SDPA has none): q [B, kvh, n, d] (GQA groups as
    rows), k, v [B, kvh, L, d]; mask additive or bool [.., n, L], None: causal over the last n keys."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    n, length = s.shape[-2:]
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool, device=s.device).tril(length - n)
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (s.softmax(-1) @ v.float()).to(q.dtype)


def decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The first meta.num_decode rows of q [T, heads, d], each over its own prefix -> [D, heads, d]."""
    d = meta.num_decode
    kvh, head_dim = k_cache.shape[-2:]
    # The query heads sharing a KV head act as that head's "query rows": [D, kvh, group, d].
    qd = q[:d].view(d, kvh, -1, head_dim)
    k = gather(k_cache, meta.decode_block_tables)          # [D, kvh, L, d]
    v = gather(v_cache, meta.decode_block_tables)
    mask = decode_mask(meta, k_cache.shape[1], q.dtype, window)
    o = sdpa(qd, k, v, mask, scale, softcap)
    return o.reshape(d, -1, head_dim)


def window_mask(p, window: int) -> torch.Tensor | None:
    """The PrefillSeq's mask [q_len, ctx_len] (None: plain causal), narrowed to a sliding window: the query
    at position i sees keys (i - window, i]."""
    if not window or p.ctx_len <= window:
        return p.mask
    n = p.q_end - p.q_start
    pos = torch.arange(p.ctx_len - n, p.ctx_len, device=p.block_table.device)[:, None]
    keys = torch.arange(p.ctx_len, device=p.block_table.device)[None, :]
    return (keys <= pos) & (keys > pos - window)


def prefill_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, out: torch.Tensor, window: int = 0, softcap: float = 0.0) -> None:
    """Every PrefillSeq's queries, causal over its context (within the window), written into out
    [T, heads, d]."""
    for p in meta.prefills:
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)          # [1, heads, n, d]
        k = gather(k_cache, p.block_table[None])[:, :, : p.ctx_len]     # [1, kvh, ctx, d]
        v = gather(v_cache, p.block_table[None])[:, :, : p.ctx_len]
        mask = window_mask(p, window)
        if softcap:           # the query heads sharing a KV head as its rows: [1, kvh, group * n, d]
            kvh, n = k.shape[1], qp.shape[2]
            qg = qp.view(1, kvh, -1, n, qp.shape[-1]).flatten(2, 3)
            full = torch.ones(n, p.ctx_len, dtype=torch.bool, device=qp.device).tril(p.ctx_len - n) \
                if mask is None else mask
            o = sdpa(qg, k, v, full.repeat(qg.shape[2] // n, 1), scale, softcap).view(qp.shape)
        else:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True)
        out[p.q_start:p.q_end] = o.squeeze(0).transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [T, heads, head_dim] -> out: [T, heads, head_dim]; window, softcap: see Backend.attention."""
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = decode_rows(q, k_cache, v_cache, meta, scale, window, softcap)
    prefill_rows(q, k_cache, v_cache, meta, scale, out, window, softcap)
    return out
