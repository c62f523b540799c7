"""ctypes bindings of the C paged attention kernels: tiles of query rows over K stored keys-last
(attention_tiled.c), and every row alone over the paired layout (attention_avx512bf16.c, AVX512-BF16).

`tiled_supports` / `paired_supported` are False when a library cannot be built here (no compiler) or is
disabled with LORAPLEX_CPU_KERNELS=0; callers then use the torch path.
"""
from __future__ import annotations

import torch

from kernels.cpu.build import has_avx512_bf16, load_functions

MAX_HEADS, MAX_HEAD_DIM = 128, 256   # as compiled into attention_tiled.c


# --- tiles of query rows (attention_tiled.c): K keys-last, every token a row ---------------------

_TILED: dict | None | bool = False
TILE_ROWS = 8     # rows of one request a tile takes: a K/V block is widened once for them (more, fewer tasks)
MAX_BLOCK = 256   # as compiled into attention_tiled.c
SPLIT_KEYS = 512  # a row's keys are taken this many at a time, by separate tasks, then merged: one long
                  # context runs on every core; the split points depend on the row's length alone


def _tiled_fns():
    global _TILED
    if _TILED is False:
        _TILED = load_functions("attention_tiled", {torch.bfloat16: "paged_tiled_attention_bf16",
                                                    torch.float32: "paged_tiled_attention_f32"})
    return _TILED


def tiled_supports(dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
    """Whether the tiled kernel runs here for this dtype and shape (block_size <= MAX_BLOCK too)."""
    fns = _tiled_fns()
    return fns is not None and dtype in fns and num_heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM


def keys_last_views(storage: torch.Tensor, num_layers: int, block_size: int, kv_heads: int, head_dim: int):
    """Per layer (K, V) views of the page pool [num_pages, page_elems] for tiled_attention: K keys-last
    [num_pages, kv_heads, head_dim, block_size] (a key's dims one block apart, so that the scores of a
    query against a block's keys are block-wide vector FMAs), V in rows [num_pages, block_size, kv_heads,
    head_dim] (a page holds [layers, 2, block] as in the row layout; only the order inside a block differs)."""
    n = storage.shape[0]
    paged = storage.view(n, num_layers, 2, block_size * kv_heads * head_dim)
    return [(paged[:, i, 0].view(n, kv_heads, head_dim, block_size),
             paged[:, i, 1].view(n, block_size, kv_heads, head_dim)) for i in range(num_layers)]


def write_kv_keys_last(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim] -> token t's slot (pages[t], offsets[t]) of keys_last_views."""
    k_cache[pages, :, :, offsets] = k
    v_cache[pages, offsets] = v


def tiled_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    tiles: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [R, H, d]; k_cache [num_pages, kv_heads, d, block_size], v_cache [num_pages, block_size, kv_heads,
    d]: keys_last_views (one page stride); block_tables: [S, max_blocks] int32 pages of each request;
    tiles: [N, 4] int32 (request, first row, rows, first row's length), covering every row once
    (kernels/attention_metadata.py); window, softcap: see Backend.attention -> out [R, H, d]."""
    r, h, d = q.shape
    n, kvh, hd, bs = k_cache.shape
    assert hd == d and v_cache.shape == (n, bs, kvh, d) and v_cache.stride(0) == k_cache.stride(0)
    assert k_cache[0].is_contiguous() and v_cache[0].is_contiguous(), "K/V blocks must be keys_last_views"
    assert q.dtype == k_cache.dtype == v_cache.dtype and h <= MAX_HEADS
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    tiles = tiles.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = _tiled_fns()[q.dtype](q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                               block_tables.data_ptr(), block_tables.shape[1], tiles.data_ptr(), tiles.shape[0], h,
                               kvh, d, bs, scale, max(1, SPLIT_KEYS // bs), window, softcap)
    if rc != 0:
        raise RuntimeError(f"paged_tiled_attention failed with code {rc} (heads {h}, kv heads {kvh}, dim {d})")
    return out


# --- the paired block layout (attention_avx512bf16.c): bf16 K/V stored as vdpbf16ps consumes them ----------

# q, q stride, out, k, v, page stride, tables, max blocks, lens, rows, heads, kv heads, dim, block, scale
_PAIRED: dict | None | bool = False


def _paired_fns():
    global _PAIRED
    if _PAIRED is False:
        _PAIRED = None
        if has_avx512_bf16():
            attn = load_functions("attention_avx512bf16", {0: "paired_attention_bf16"})
            write = load_functions("attention_avx512bf16", {0: "write_kv_paired_bf16"})
            if attn is not None and write is not None:
                _PAIRED = {"attention": attn[0], "write": write[0]}
    return _PAIRED


def paired_supported(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the engine can keep this model's KV cache in the paired layout here."""
    return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 1024 and block_size % 16 == 0
            and _paired_fns() is not None)


def paired_views(storage: torch.Tensor, num_layers: int, block_size: int, kv_heads: int, head_dim: int):
    """Per layer (K, V) views of the page pool [num_pages, page_elems] in the paired layout:
    K [num_pages, kv_heads, head_dim / 2, block_size, 2] and V [num_pages, kv_heads, block_size / 2, head_dim, 2]
    (a page holds [layers, 2, block] as in the row layout; only the order inside a block differs)."""
    n = storage.shape[0]
    paged = storage.view(n, num_layers, 2, block_size * kv_heads * head_dim)
    return [(paged[:, i, 0].view(n, kv_heads, head_dim // 2, block_size, 2),
             paged[:, i, 1].view(n, kv_heads, block_size // 2, head_dim, 2)) for i in range(num_layers)]


def unpair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Paired views -> copies in the row layout [num_pages, block_size, kv_heads, head_dim]."""
    n, kvh, half, bs, _ = k_cache.shape
    k = k_cache.permute(0, 3, 1, 2, 4).reshape(n, bs, kvh, 2 * half)
    v = v_cache.permute(0, 2, 4, 1, 3).reshape(n, bs, kvh, 2 * half)
    return k, v


def _check_paired(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    assert k_cache.dim() == 5, "K/V caches must be paired views"
    n, kvh, half, bs, two = k_cache.shape
    assert two == 2 and v_cache.shape == (n, kvh, bs // 2, 2 * half, 2), "K/V caches must be paired views"
    assert k_cache.stride(0) == v_cache.stride(0) and k_cache[0].is_contiguous() and v_cache[0].is_contiguous()
    assert k_cache.dtype == v_cache.dtype == torch.bfloat16
    return kvh, 2 * half, bs, k_cache.stride(0)


def paired_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Every row over its own prefix, over paired views (see paired_views): q [D, H, d] bf16 (each row's
    heads contiguous; rows at any stride, e.g. a view of the fused qkv); block_tables [D, max_blocks]
    int64 each row's pages; lens [D] int64 each row's length; window, softcap: see Backend.attention ->
    out [D, H, d]."""
    kvh, d, bs, page_stride = _check_paired(k_cache, v_cache)
    rows, h, qd = q.shape
    assert qd == d and q.dtype == torch.bfloat16 and h % kvh == 0
    if q.stride()[1:] != (d, 1):
        q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    assert block_tables.shape[0] == lens.shape[0] == rows
    out = torch.empty(rows, h, d, dtype=q.dtype)
    rc = _paired_fns()["attention"](q.data_ptr(), q.stride(0), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    page_stride,
                                    block_tables.data_ptr(), block_tables.shape[1], lens.data_ptr(), rows, h, kvh, d,
                                    bs, scale, window, softcap)
    if rc != 0:
        raise RuntimeError(f"paired_attention failed with code {rc} (heads {h}, kv heads {kvh}, dim {d}, block {bs})")
    return out


def write_kv_paired(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """The paired-layout counterpart of elementwise.write_kv: k, v [T, kv_heads, d] (each token's row
    contiguous) -> slot offsets[t] of page pages[t] (int64 [T], in range: not checked here)."""
    kvh, d, bs, page_stride = _check_paired(k_cache, v_cache)
    t = k.shape[0]
    assert k.shape == v.shape == (t, kvh, d) and k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1)
    assert k.dtype == v.dtype == torch.bfloat16 and pages.dtype == offsets.dtype == torch.int64
    assert pages.is_contiguous() and offsets.is_contiguous() and pages.shape == offsets.shape == (t,)
    rc = _paired_fns()["write"](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                v_cache.data_ptr(), page_stride, pages.data_ptr(), offsets.data_ptr(), t, kvh, d, bs)
    if rc != 0:
        raise RuntimeError(f"write_kv_paired failed with code {rc}")
