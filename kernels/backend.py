"""The compute backend interface: everything one engine step needs from compute, and nothing else.

The model (engine/model/llama.py) and the model runner call only these methods; each kind of hardware
implements them once (kernels/reference: plain torch, the oracle; kernels/cpu: the C kernels;
kernels/triton: the Triton kernels). `kernels.selector.select_backend` picks one. Shapes below use
T tokens in the step, H hidden size, q = heads * head_dim, kv = kv_heads * head_dim, I intermediate size,
S compute slots, R max LoRA rank. Every backend must give the reference backend's results within the
per-dtype tolerances of tests/kernels/test_backends.py, and PEFT's greedy tokens in float32
(tests/engine/test_backend_fidelity.py).

Invariants every implementation keeps:
- A token's result never depends on which other tokens share the step (no batch-shape-dependent
  reductions), so a request's output does not depend on its neighbours.
- Methods that update in place say so; every other method returns a new tensor or a view.
- The KV cache of a layer is whatever view `kv_caches` returned for it: only this backend reads or
  writes it (write_kv, attention, decoder).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.lora_layout import LoraPacker, PackedLayout

KVCache = tuple[torch.Tensor, torch.Tensor]   # one layer's (K, V) views of the page pool


class ModelShape(Protocol):
    """What a backend needs to know of the model (engine.config.ModelConfig has these)."""
    dtype: torch.dtype
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float

    @property
    def q_size(self) -> int: ...

    @property
    def kv_size(self) -> int: ...


class LinearOp(Protocol):
    """y = x @ weight^T, weight [out, in] packed once for the backend. x: [T, in] -> y: [T, out] in the
    weight's dtype."""
    weight: torch.Tensor
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class LoraStep(Protocol):
    """The multi-LoRA deltas of one step, built by Backend.lora_step and used for every layer.

    group is one of "qkv", "o", "gate_up", "down" (the fused projections); adapter a's delta of group g
    for token t is  scale_a * B_a @ (A_a @ x[t]), over the modules of g that a targets (zero elsewhere)."""

    def project(self, linear: LinearOp, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        """linear(x) plus every token's adapter delta of `group` at `layer`. x: [T, in] -> [T, out]."""


class AdapterSlots(Protocol):
    """The adapters a backend may compute with: their places in the pool's pages, read in place (CPU: pointers
    to its blocks; Triton: page tables), or a copy in compute slots (the reference backend, the oracle). A
    slot is a small int naming an assigned adapter.

    Pair every check with its action: `can_assign(busy)` is True iff `assign(..., busy)` will succeed. An
    adapter in `busy` (running now) is never replaced; the least recently assigned other one may be. An
    adapter is dropped (`drop`) before its pages are freed or reused."""
    slot_of: dict[int, int]   # adapter id -> its slot, for every assigned adapter
    capacity: int | None      # adapters assignable at once; None: any number (the pool bounds them)

    def has(self, adapter_id: int) -> bool: ...

    def can_assign(self, busy: set[int]) -> bool: ...

    def assign(self, adapter_id: int, layout: PackedLayout, pages: Sequence[int], busy: set[int]) -> int:
        """Take an adapter resident in these pages of the pool (in order; `kernels/lora_layout.py`);
        returns its slot."""

    def drop(self, adapter_id: int) -> None: ...


class InPlaceSlots:
    """The common part of AdapterSlots for backends that read adapters in place in the pool's pages (CPU,
    Triton): any number of adapters at once (`capacity` None: the pool bounds them), nothing to replace,
    and a new adapter's slot the smallest number not in use. `entries[slot]`: what the backend keeps."""
    capacity = None

    def __init__(self):
        self.slot_of: dict[int, int] = {}
        self.entries: dict[int, object] = {}

    def has(self, adapter_id: int) -> bool:
        return adapter_id in self.slot_of

    def can_assign(self, busy: set[int]) -> bool:
        return True

    def new_slot(self) -> int:
        return min(set(range(len(self.entries) + 1)) - set(self.entries))

    def drop(self, adapter_id: int) -> None:
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            del self.entries[slot]
            self.dropped(slot)

    def dropped(self, slot: int) -> None:
        """A subclass forgets what else it kept for the slot."""


class DoraRows(Protocol):
    """A step's DoRA row scales as the kernels take them (built by engine/model/dora_scales.py): for each
    (layer, group) some DoRA adapter of the step adapts, `offs[index[(layer, group)]]` [T] int64 gives each
    token row's element offset of its vector of g - 1 in `storage` ([num_pages, page_elems], the pool),
    -1 for rows left alone (Backend.dora_scale's offs)."""
    storage: torch.Tensor
    offs: torch.Tensor              # [K, T] int64, rows contiguous
    index: dict[tuple[int, str], int]


class FusedDecoder(Protocol):
    """All decoder layers of a step in one call, with the bits of the op-by-op loop (LlamaModel._layers)."""

    def accepts(self, meta: AttentionMetadata, lora: LoraStep | None) -> bool:
        """Whether run() takes this step (else the model runs the layers op by op)."""

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            lora: LoraStep | None, local: tuple | None = None, dora: DoraRows | None = None) -> torch.Tensor:
        """x: [T, H] the embeddings, updated in place to the residual stream before the last layer's MLP
        residual add, which is returned ([T, H]; the caller adds it). cos, sin: [T, head_dim]; local: the
        sliding layers' own (cos, sin) where the model has them (Gemma 3), else None; dora: the DoRA rows'
        scales, applied after each group's LoRA deltas as the loop does (Backend.dora_scale). The model's
        family switches (engine/model/family.py) are the decoder's to honour, as the loop does."""


class Backend(ABC):
    """One kind of compute. Built once per engine for one model shape (its dtype included), device and KV
    block size: everything a backend decides (which kernels, which KV layout, which attention metadata)
    is decided in its constructor, never later as a side effect."""
    name: str = "abstract"

    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu", block_size: int = 16):
        self.shape = shape
        self.dtype = shape.dtype
        self.device = torch.device(device)
        self.block_size = block_size    # tokens per KV block (one page of the pool holds one of every layer)

    # -- memory layout ---------------------------------------------------------------------------------
    def kv_caches(self, storage: torch.Tensor, num_layers: int, block_size: int, kv_heads: int,
                  head_dim: int) -> list[KVCache]:
        """Per-layer (K, V) views of the page pool storage [num_pages, page_elems]. A page holds one block of
        every layer, [layers, 2 (K, V), block_size * kv_heads * head_dim]; block_size must be the backend's
        own (ValueError otherwise). Default: the row layout, K and V [num_pages, block_size, kv_heads,
        head_dim]. Only views: the same storage gives the same views every time."""
        self.check_block_size(block_size)
        n = storage.shape[0]
        paged = storage.view(n, num_layers, 2, block_size, kv_heads, head_dim)
        return [(paged[:, i, 0], paged[:, i, 1]) for i in range(num_layers)]

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.block_size:
            raise ValueError(f"backend {self.name!r} was built for blocks of {self.block_size} tokens, not "
                             f"{block_size}")

    @property
    def every_token_a_row(self) -> bool:
        """True when attention takes every token of the step as one query row over its own prefix (the
        model runner then puts no PrefillSeq in the metadata: see AttentionMetadata)."""
        return False

    @property
    def query_tile_rows(self) -> int:
        """0, or the most rows of one request a tile takes: then the model runner describes the rows (every
        token a row) as tiles over per-request block tables (AttentionMetadata.query_tiles)."""
        return 0

    # -- the base model -------------------------------------------------------------------------------
    @abstractmethod
    def linear(self, weight: torch.Tensor) -> LinearOp:
        """Pack weight [out, in] (the model dtype) once for this backend's GEMM."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * rms_norm(x.float(), eps).to(x.dtype), as Hugging Face Llama. x: [T, H] -> [T, H]."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += d in place (the residual stream), then rms_norm(x). x, d: [T, H] -> [T, H]."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up]: [T, 2I] -> [T, I]."""

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up (Gemma's GeGLU), each op rounded to the dtype as torch's:
        [T, 2I] -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def add_bias(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x + bias (a projection's bias, after its adapters' deltas): x [T, N], bias [N] -> [T, N], rounded
        once to x's dtype. May update x in place and return it (x is the step's own projection output)."""
        return x.add_(bias)

    def head_norms(self, q_k: torch.Tensor, num_q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """rms_norm of every head of q_k [T, heads + kv_heads, d] over d: the first num_q_heads with q_weight
        [d], the rest with k_weight [d] (Qwen3's q/k norms) -> [T, heads + kv_heads, d], the bits of
        rms_norm on each head's row."""
        t, n, d = q_k.shape
        q = self.rms_norm(q_k[:, :num_q_heads].reshape(-1, d), q_weight, eps).view(t, num_q_heads, d)
        k = self.rms_norm(q_k[:, num_q_heads:].reshape(-1, d), k_weight, eps).view(t, n - num_q_heads, d)
        return torch.cat([q, k], dim=1)

    @abstractmethod
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half form): x [T, heads, d]; cos, sin [T, d] -> rotated [T, heads, d].
        May rotate x in place and return it (x is a view of the step's own qkv)."""

    @abstractmethod
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """k, v: [T, kv_heads, d] -> the cache slots (meta.slot_page, meta.slot_offset) of the step's tokens."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Causal attention over the paged cache, the step's new K/V already written: q [T, heads, d] ->
        [T, heads, d]; query heads share KV heads in groups (GQA). window > 0: a row of length L (its query
        at position L - 1) attends to its last `window` keys only, [max(0, L - window), L). softcap > 0:
        each score s = scale * q.k becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)."""

    # -- multi-LoRA -------------------------------------------------------------------------------------
    def lora_packer(self) -> LoraPacker:
        """How adapters are laid out in the pool's pages for this backend's kernels (kernels/lora_layout.py):
        by default each module's A and B row-major, one after another."""
        return LoraPacker()

    @abstractmethod
    def lora_slots(self, num_slots: int | None, max_rank: int, shape: ModelShape,
                   storage: torch.Tensor) -> AdapterSlots:
        """The adapters' compute working set: adapters of rank <= max_rank resident in the page pool `storage`
        ([num_pages, page_elems], the model dtype), packed by lora_packer(); at most num_slots at once where
        the backend copies them into slots (None: no bound but the pool's)."""

    @abstractmethod
    def lora_step(self, slots: AdapterSlots, token_slots: Sequence[int], num_decode: int) -> LoraStep | None:
        """The step's LoRA: token_slots[t] is token t's slot (-1: the base model); the first num_decode
        tokens are decode tokens (one per request). None when no token has an adapter."""

    def dora_scale(self, y: torch.Tensor, storage: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """DoRA's row scales (engine/lora/dora.py) on a projection group's output before any bias: y [T, N]; each
        row t with offs[t] >= 0 becomes y[t] + y[t] * d_t rounded once to y's dtype (torch's addcmul), d_t the
        N elements of storage.view(-1) from offs[t] (its adapter's vector, in the pool's pages); the other
        rows are left alone. offs: [T] int64 on y's device. May update y in place; returns the result."""
        rows = (offs >= 0).nonzero().squeeze(1)
        if rows.numel():
            d = storage.view(-1)[offs[rows][:, None] + torch.arange(y.shape[1], device=y.device)]
            y[rows] = torch.addcmul(y[rows], y[rows], d)
        return y

    # -- optional fusions -------------------------------------------------------------------------------
    def decoder(self, shape: ModelShape, layers: Sequence, kv_caches: list[KVCache]) -> FusedDecoder | None:
        """A fused whole-step decoder over these layers (engine.model.weights.LayerWeights, built with
        this backend's linear) and caches, or None (the default: layers run op by op)."""
        return None

    # -- sampling ---------------------------------------------------------------------------------------
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, vocab] (any float dtype) -> [B] int64 index of each row's largest value (the first
        one on ties)."""
        return logits.argmax(dim=-1)

    def mask_logits_(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """In place on logits [B, vocab] (any float dtype): for each row r of `rows`, every token i whose
        bit (i % 32 of mask[r, i // 32], mask an int32 [B, ceil(vocab / 32)] on the host: xgrammar's layout)
        is 0 becomes -inf; the other entries and rows are untouched. -> logits."""
        bits = mask[rows].to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().view(len(rows), -1)[:, :logits.shape[1]]
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill_(~allowed, float("-inf"))
        return logits


