"""Triton paged attention (TRITON_INTERPRET=1 on CPU) against the fp32 torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels.triton.paged_attention import paged_attention
from tests.kernels.cpu.test_attention import random_case, reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16)])
def test_matches_reference(dtype, heads, kv_heads, d, bs):
    # lengths: one token, a partial block, exact blocks, several blocks with a partial tail
    q, k_cache, v_cache, tables, lens = random_case(dtype, heads, kv_heads, d, bs, [1, 5, bs, 2 * bs, 3 * bs + 7])
    out = paged_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    ref = reference(q, k_cache, v_cache, tables, lens, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_rows_each_over_their_own_prefix():
    """A prefill chunk is rows of one request with lengths pos + 1: causal attention, one table."""
    q, k_cache, v_cache, tables, _ = random_case(torch.float32, 9, 3, 64, 16, [40])
    lens = torch.arange(30, 40) + 1                     # the chunk's tokens at positions 30..39
    qs = torch.randn(len(lens), 9, 64)
    out = paged_attention(qs, k_cache, v_cache, tables.expand(len(lens), -1), lens, 0.125)
    torch.testing.assert_close(out, reference(qs, k_cache, v_cache, tables.expand(len(lens), -1), lens, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_shapes_it_cannot_tile_are_refused():
    q, k_cache, v_cache, tables, lens = random_case(torch.float32, 6, 3, 48, 16, [3])
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q, k_cache, v_cache, tables, lens, 0.1)
