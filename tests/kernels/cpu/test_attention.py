"""The fp32 torch reference the C attention kernels are tested against (test_tiled_attention.py,
test_paired_attention.py), and a check of the reference itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import query_tiles


def make_cache(num_pages, layers, bs, kvh, d, dtype, layer, seed=0):
    """Views of one layer of a page pool laid out as the model runner's: [pages, layers, 2, bs, kvh, d]."""
    g = torch.Generator().manual_seed(seed)
    storage = torch.randn(num_pages, layers * 2 * bs * kvh * d, generator=g).to(dtype)
    paged = storage.view(num_pages, layers, 2, bs, kvh, d)
    return paged[:, layer, 0], paged[:, layer, 1]


def reference(q, k_cache, v_cache, tables, lens, scale):
    """fp32, one sequence at a time: q [D, H, d] -> [D, H, d]."""
    _, h, d = q.shape
    kvh = k_cache.shape[2]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        k = k_cache[tables[s]].reshape(-1, kvh, d)[:n].float().repeat_interleave(h // kvh, dim=1)
        v = v_cache[tables[s]].reshape(-1, kvh, d)[:n].float().repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,thd->ht", q[s].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


def random_rows(chunks, heads, d, bs, dtype, rows_per_tile, num_pages, g):
    """A step whose requests compute chunks [(tokens already computed, new tokens)], every token a row, the
    rows in tiles -> (q [R, heads, d], tables [S, width] int32 over random distinct pages, tiles [N, 4]
    int32, the most rows of a tile; for the reference: each row's table [R, width] and length [R])."""
    width = max(-(-(s + n) // bs) for s, n in chunks)
    tables = torch.randperm(num_pages, generator=g)[: width * len(chunks)].view(len(chunks), width)
    tiles, row = [], 0
    for seq, (start, n) in enumerate(chunks):
        tiles += query_tiles(row, seq, start, n, rows_per_tile)
        row += n
    q = torch.randn(row, heads, d, generator=g).to(dtype)
    row_tables = torch.cat([tables[s].expand(n, -1) for s, (_, n) in enumerate(chunks)])
    row_lens = torch.cat([torch.arange(start + 1, start + n + 1) for start, n in chunks])
    return (q, tables.to(torch.int32), torch.tensor(tiles, dtype=torch.int32), max(t[2] for t in tiles),
            row_tables, row_lens)


def random_case(dtype, heads, kv_heads, d, bs, lens, num_pages=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = make_cache(num_pages, 3, bs, kv_heads, d, dtype, layer=1, seed=seed)
    lens = torch.tensor(lens)
    width = int(-(-lens.max() // bs))
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, lens


def test_sdpa_reference_sanity():
    """The reference itself equals SDPA on a plain (unpaged) layout."""
    q, kc, vc, tables, lens = random_case(torch.float32, 4, 2, 32, 8, [24])
    k = kc[tables[0]].reshape(-1, 2, 32)[:24].transpose(0, 1).repeat_interleave(2, 0)
    v = vc[tables[0]].reshape(-1, 2, 32)[:24].transpose(0, 1).repeat_interleave(2, 0)
    sdpa = F.scaled_dot_product_attention(q[0][:, None], k, v, scale=0.2)[:, 0]
    torch.testing.assert_close(reference(q, kc, vc, tables, lens, 0.2)[0], sdpa, atol=1e-5, rtol=1e-5)
