"""The Triton backend: Triton kernels where this package has them (paged attention over block tables,
every token one query row, a request's rows in tiles), the reference backend's torch ops for the rest.
On a CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported):
slow, for tests.

Multi-LoRA reads every adapter in place in the pool's pages, at its own rank (paged_lora.py: BGMV for
decode tokens, SGMV for prefill segments).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.backend import ModelShape
from kernels.reference.backend import TorchBackend


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu", block_size: int = 16):
        super().__init__(shape, device, block_size)
        if not self.runs_on(self.device):
            raise ValueError(f"backend 'triton': needs a CUDA device, or TRITON_INTERPRET=1 on {self.device}")
        # NOTE: these import triton, which reads TRITON_INTERPRET once, when first imported
        from kernels.triton import dora_ops, paged_attention, paged_lora
        self._dora_scale = dora_ops.dora_scale_
        self._paged_attention = paged_attention.paged_attention
        self._tile_rows = paged_attention.tile_rows(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype)
        self._paged_lora = paged_lora

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        """Whether Triton kernels can run on `device` in this process."""
        if device.type == "cuda":
            return torch.cuda.is_available()
        return os.environ.get("TRITON_INTERPRET") == "1" and _importable()

    @property
    def every_token_a_row(self) -> bool:
        return True

    @property
    def query_tile_rows(self) -> int:
        return self._tile_rows

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                  softcap: float = 0.0):
        assert not meta.prefills and meta.num_decode == q.shape[0], "every token is a row here"
        return self._paged_attention(q, k_cache, v_cache, meta.seq_block_tables, meta.query_tiles,
                                     meta.max_tile_rows, scale, meta.max_context, window=window, softcap=softcap)

    def dora_scale(self, y, storage, offs):
        return self._dora_scale(y, storage, offs)

    def lora_slots(self, num_slots: int, max_rank: int, shape: ModelShape, storage: torch.Tensor):
        return self._paged_lora.PagedAdapters(shape, storage)

    def lora_step(self, slots, token_slots: Sequence[int], num_decode: int):
        return self._paged_lora.PagedLoraStep.build(slots, token_slots, num_decode)


def _importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
