"""The CPU backend: the C kernels of this package where they cover the dtype and shapes, the reference
backend's torch ops elsewhere (per op, decided once).

The KV mode (`KvMode`: paired, keys-last or rows) is chosen once, when the backend is built for its
block size, and fixes the KV views, the attention kernel and the metadata it takes.
bf16 on AVX512-BF16: packed GEMM with decode tokens' LoRA inside it, KV in the paired layout that
vdpbf16ps reads, and the one-call decoder (decoder.c). bf16 on AVX2 + FMA: the fp32-compute GEMM and
LoRA kernels, K stored keys-last and attention over tiles of rows (attention_tiled.c). float32:
that attention, elementwise ops and LoRA decode kernel over torch GEMMs.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.backend import KVCache, ModelShape
from kernels.cpu import attention as c_attention
from kernels.cpu import elementwise
from kernels.cpu.decoder import Decoder
from kernels.cpu.linear import CpuLinear
from kernels.cpu.lora_batch import LoraBatch
from kernels.cpu.lora_pack import GroupPacker
from kernels.cpu.paged_adapters import CpuPagedAdapters
from kernels.reference.backend import TorchBackend


class KvMode(enum.Enum):
    """How the CPU backend keeps and reads the KV cache; one per backend, chosen when it is built."""
    PAIRED = "paired"        # bf16 K/V in the pairs vdpbf16ps reads; every token a row; the one-call decoder
    KEYS_LAST = "keys_last"  # K stored keys-last; a request's rows in tiles of TILE_ROWS (attention_tiled.c)
    ROWS = "rows"            # the reference layout and SDPA over gathered blocks (no C attention kernel fits)


def kv_mode(dtype: torch.dtype, num_heads: int, head_dim: int, block_size: int) -> KvMode:
    """The fastest mode this host's C kernels run for this shape and block size."""
    if not c_attention.tiled_supports(dtype, num_heads, head_dim) or block_size > c_attention.MAX_BLOCK:
        return KvMode.ROWS
    if c_attention.paired_supported(dtype, head_dim, block_size):
        return KvMode.PAIRED
    return KvMode.KEYS_LAST


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu", block_size: int = 16):
        super().__init__(shape, device, block_size)
        self.fused_ops = elementwise.supports(self.dtype)
        self.kv_mode = kv_mode(self.dtype, shape.num_heads, shape.head_dim, block_size)

    @staticmethod
    def available() -> bool:
        """Whether any C kernel runs here (a compiler, and not disabled)."""
        return elementwise.supports(torch.float32)

    # -- memory layout ---------------------------------------------------------------------------------
    def kv_caches(self, storage, num_layers, block_size, kv_heads, head_dim) -> list[KVCache]:
        self.check_block_size(block_size)
        if self.kv_mode == KvMode.PAIRED:
            return c_attention.paired_views(storage, num_layers, block_size, kv_heads, head_dim)
        if self.kv_mode == KvMode.KEYS_LAST:
            return c_attention.keys_last_views(storage, num_layers, block_size, kv_heads, head_dim)
        return super().kv_caches(storage, num_layers, block_size, kv_heads, head_dim)

    @property
    def every_token_a_row(self) -> bool:
        """Both C modes take every token as a query row (no PrefillSeq in their metadata)."""
        return self.kv_mode != KvMode.ROWS

    @property
    def query_tile_rows(self) -> int:
        """Rows in tiles for the keys-last kernel; the paired kernel takes rows one by one."""
        return c_attention.TILE_ROWS if self.kv_mode == KvMode.KEYS_LAST else 0

    # -- the base model --------------------------------------------------------------------------------
    def linear(self, weight: torch.Tensor) -> CpuLinear:
        return CpuLinear(weight)

    def rms_norm(self, x, weight, eps):
        return elementwise.rms_norm(x, weight, eps) if self.fused_ops else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, d, weight, eps):
        if self.fused_ops:
            return elementwise.add_rms_norm(x, d, weight, eps)
        return super().add_rms_norm(x, d, weight, eps)

    def silu_mul(self, gate_up):
        return elementwise.silu_mul(gate_up) if self.fused_ops else super().silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up):
        return elementwise.gelu_tanh_mul(gate_up) if self.fused_ops else super().gelu_tanh_mul(gate_up)

    def dora_scale(self, y, storage, offs):
        return elementwise.dora_scale_(y, storage, offs) if self.fused_ops else super().dora_scale(y, storage, offs)

    def rope(self, x, cos, sin):
        # in place: x is a view of this step's fused qkv
        return elementwise.rope_(x, cos, sin) if self.fused_ops else super().rope(x, cos, sin)

    def write_kv(self, k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
        if self.kv_mode == KvMode.PAIRED:
            c_attention.write_kv_paired(k_cache, v_cache, k, v, meta.slot_page, meta.slot_offset)
        elif self.kv_mode == KvMode.KEYS_LAST:
            c_attention.write_kv_keys_last(k_cache, v_cache, k, v, meta.slot_page, meta.slot_offset)
        elif self.fused_ops:
            elementwise.write_kv(k_cache, v_cache, k, v, meta.slot_page, meta.slot_offset)
        else:
            super().write_kv(k_cache, v_cache, k, v, meta)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                  softcap: float = 0.0):
        if self.kv_mode == KvMode.ROWS:
            return super().attention(q, k_cache, v_cache, meta, scale, window, softcap)
        assert not meta.prefills and meta.num_decode == q.shape[0], "the C kernels take every token as a row"
        if self.kv_mode == KvMode.PAIRED:
            return c_attention.paired_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                                scale, window, softcap)
        return c_attention.tiled_attention(q, k_cache, v_cache, meta.seq_block_tables, meta.query_tiles, scale,
                                           window, softcap)

    # -- multi-LoRA ------------------------------------------------------------------------------------
    def lora_packer(self) -> GroupPacker:
        """Adapters in pages as the C kernels read them: per (layer, group) blocks (kernels/cpu/lora_pack.py)."""
        return GroupPacker(self.dtype)

    def lora_slots(self, num_slots: int | None, max_rank: int, shape: ModelShape,
                   storage: torch.Tensor) -> CpuPagedAdapters:
        """Adapters read in place in their pages: no slots, no copies, no count but the pool's."""
        return CpuPagedAdapters(max_rank, shape, storage)

    def lora_step(self, slots: CpuPagedAdapters, token_slots: Sequence[int], num_decode: int) -> LoraBatch | None:
        return LoraBatch.build(slots, list(token_slots), num_decode)

    def decoder(self, shape, layers, kv_caches) -> Decoder | None:
        return Decoder.create(shape, layers, kv_caches) if self.kv_mode == KvMode.PAIRED else None

    # -- sampling --------------------------------------------------------------------------------------
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """bf16 rows through the C kernel, which reads them once (no fp32 copy)."""
        if logits.dtype == torch.bfloat16 and logits.stride(-1) == 1 and elementwise.supports(torch.bfloat16):
            return elementwise.argmax(logits)
        return logits.argmax(dim=-1)

    def mask_logits_(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Through the C kernel (one pass over the masked rows, words with every bit set skipped)."""
        if logits.stride(-1) == 1 and logits.dtype in (torch.bfloat16, torch.float32) \
                and elementwise.supports(logits.dtype):
            return elementwise.mask_logits_(logits, mask, torch.tensor(rows, dtype=torch.int64))
        return super().mask_logits_(logits, mask, rows)
