"""The C paged decode attention against an fp32 torch reference and against the engine's torch path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.cpu import attention as cpu_attention
from kernels.reference import attention as torch_attention

pytestmark = pytest.mark.skipif(not cpu_attention.supports(torch.float32), reason="no C compiler here")


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


def random_case(dtype, heads, kv_heads, d, bs, lens, num_pages=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = make_cache(num_pages, 3, bs, kv_heads, d, dtype, layer=1, seed=seed)
    lens = torch.tensor(lens)
    width = int(-(-lens.max() // bs))
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
@pytest.mark.parametrize("bs", [16, 4])
def test_matches_fp32_reference(dtype, tol, heads, kv_heads, d, bs):
    lens = [1, bs, bs + 1, 3 * bs - 1, 100, 7]
    q, kc, vc, tables, lens_t = random_case(dtype, heads, kv_heads, d, bs, lens)
    out = cpu_attention.decode_attention(q, kc, vc, tables, lens_t, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, kc, vc, tables, lens_t, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_ignores_padding_past_each_length():
    """Table entries past a sequence's length point at pages full of other data: they must not count."""
    q, kc, vc, tables, lens = random_case(torch.float32, 9, 3, 64, 16, [5, 40])
    out = cpu_attention.decode_attention(q, kc, vc, tables, lens, 0.125)
    poisoned = tables.clone()
    poisoned[0, 1:] = tables[1, 0]          # garbage after the first block of a 5-token sequence
    again = cpu_attention.decode_attention(q, kc, vc, poisoned, lens, 0.125)
    torch.testing.assert_close(out, again, atol=0, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_same_as_the_torch_path(dtype, tol):
    """The C kernel and the reference backend's SDPA over gathered blocks agree."""
    bs, lens = 16, [3, 17, 64, 33]
    q, kc, vc, tables, lens_t = random_case(dtype, 9, 3, 64, bs, lens)
    empty = torch.empty(0, dtype=torch.long)
    meta = AttentionMetadata(empty, empty, len(lens), tables, lens_t, [])
    c_out = cpu_attention.decode_attention(q, kc, vc, tables, lens_t, 0.125)
    torch_out = torch_attention.paged_attention(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(c_out.float(), torch_out.float(), atol=tol, rtol=tol)
    assert not torch.equal(c_out, torch.zeros_like(c_out))


def test_refuses_a_cache_with_scattered_rows():
    q, kc, vc, tables, lens = random_case(torch.float32, 4, 4, 32, 16, [3])
    with pytest.raises(AssertionError, match="contiguous"):
        cpu_attention.decode_attention(q, kc.transpose(1, 2), vc.transpose(1, 2), tables, lens, 0.1)


def test_sdpa_reference_sanity():
    """The reference itself equals SDPA on a plain (unpaged) layout."""
    q, kc, vc, tables, lens = random_case(torch.float32, 4, 2, 32, 8, [24])
    k = kc[tables[0]].reshape(-1, 2, 32)[:24].transpose(0, 1).repeat_interleave(2, 0)
    v = vc[tables[0]].reshape(-1, 2, 32)[:24].transpose(0, 1).repeat_interleave(2, 0)
    sdpa = F.scaled_dot_product_attention(q[0][:, None], k, v, scale=0.2)[:, 0]
    torch.testing.assert_close(reference(q, kc, vc, tables, lens, 0.2)[0], sdpa, atol=1e-5, rtol=1e-5)


def test_shapes_beyond_the_compiled_limits_fall_back():
    assert cpu_attention.fits(9, 64) and cpu_attention.fits(128, 256)
    assert not cpu_attention.fits(129, 64) and not cpu_attention.fits(8, 512)
