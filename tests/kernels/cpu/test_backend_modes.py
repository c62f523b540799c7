"""The CPU backend chooses its KV mode once, when it is built for a block size: the views, the attention
kernel and the metadata it asks for follow from that choice, and kv_caches changes nothing."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu import attention as c_attention
from kernels.cpu.backend import CpuBackend, KvMode
from tests.engine.lora.synthetic import TINY

pytestmark = pytest.mark.skipif(not CpuBackend.available(), reason="no C compiler here")
SHAPE = dataclasses.replace(TINY, num_heads=4, num_kv_heads=2, head_dim=32)


def built(dtype, block_size):
    return CpuBackend(dataclasses.replace(SHAPE, dtype=dtype), "cpu", block_size)


def test_the_mode_is_decided_when_the_backend_is_built():
    f32 = built(torch.float32, 16)
    assert f32.kv_mode == KvMode.KEYS_LAST                 # fp32: the tiled kernel over keys-last K
    assert f32.every_token_a_row and f32.query_tile_rows == c_attention.TILE_ROWS
    big = built(torch.float32, c_attention.MAX_BLOCK + 1)
    assert big.kv_mode == KvMode.ROWS                      # no C kernel takes such blocks: SDPA
    assert not big.every_token_a_row and big.query_tile_rows == 0
    bf16 = built(torch.bfloat16, 16)
    paired = c_attention.paired_supported(torch.bfloat16, 32, 16)
    assert bf16.kv_mode == (KvMode.PAIRED if paired else KvMode.KEYS_LAST)
    assert bf16.query_tile_rows == (0 if paired else c_attention.TILE_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_caches_only_makes_views(dtype):
    b = built(dtype, 16)
    before = (b.kv_mode, b.every_token_a_row, b.query_tile_rows)
    storage = torch.zeros(4, 2 * 2 * 16 * 2 * 32, dtype=dtype)
    first = b.kv_caches(storage, 2, 16, 2, 32)
    again = b.kv_caches(storage, 2, 16, 2, 32)
    assert (b.kv_mode, b.every_token_a_row, b.query_tile_rows) == before
    for (k1, v1), (k2, v2) in zip(first, again):
        assert k1.data_ptr() == k2.data_ptr() and k1.shape == k2.shape and v1.stride() == v2.stride()


def test_a_block_size_other_than_the_backends_is_refused():
    b = built(torch.float32, 16)
    with pytest.raises(ValueError, match="blocks of 16 tokens, not 32"):
        b.kv_caches(torch.zeros(4, 2 * 2 * 32 * 2 * 32), 2, 32, 2, 32)
