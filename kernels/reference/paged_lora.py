"""fp32 torch reference for the paged multi-LoRA kernels (same arguments, same meaning)."""
from __future__ import annotations

import torch


def paged_matrix(pool: torch.Tensor, pages: torch.Tensor, offset: int, rows: int, cols: int,
                 page_elems: int) -> torch.Tensor:
    """Read a row-major [rows, cols] matrix at flat `offset` of an adapter whose pages are `pages`."""
    flat = offset + torch.arange(rows * cols)
    addr = pages[flat // page_elems] * page_elems + flat % page_elems
    return pool[addr].view(rows, cols).float()


def ref_shrink(x, pool, page_table, a_off, rank, indices, max_rank, page_elems):
    v = torch.zeros(x.shape[0], max_rank)
    for t, a in enumerate(indices.tolist()):
        if a >= 0:
            r = int(rank[a])
            A = paged_matrix(pool, page_table[a], int(a_off[a]), r, x.shape[1], page_elems)
            v[t, :r] = A @ x[t].float()
    return v


def ref_expand(v, y, pool, page_table, b_off, rank, scale, indices, y_col, n_out, page_elems):
    out = y.float().clone()
    for t, a in enumerate(indices.tolist()):
        if a >= 0:
            r = int(rank[a])
            B = paged_matrix(pool, page_table[a], int(b_off[a]), n_out, r, page_elems)
            out[t, y_col:y_col + n_out] += float(scale[a]) * (B @ v[t, :r])
    return out


def segments_to_indices(seg_start: torch.Tensor, seg_adapter: torch.Tensor) -> torch.Tensor:
    idx = torch.full((int(seg_start[-1]),), -1, dtype=torch.long)
    for s, a in enumerate(seg_adapter.tolist()):
        idx[int(seg_start[s]):int(seg_start[s + 1])] = a
    return idx
