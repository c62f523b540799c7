"""Multi-LoRA on CPU (the CPU backend's LoraStep): y[t] += scale(a_t) * B(a_t) @ (A(a_t) @ x[t]) for every
token t, with no loop over adapters in Python.

Tokens are grouped once per step (`LoraBatch.build`). Decode tokens (the first `num_decode`, one per
request) go to the C kernel (kernels/cpu/lora_decode.c): one task per token that streams its adapter's
own rank of A and B once, in fp32, so a decode token's delta never depends on who shares the step or
its adapter. In bf16 with the AVX512-BF16 C GEMM, the GEMM computes those tokens' LoRA itself (`fused`,
kernels/cpu/gemm_lora.c): the adapters' bytes stream in while it computes. In bf16 with AVX512-BF16 or
AVX2, prefill tokens go to the segment kernel (tokens grouped by adapter, 4 at a time per weight load,
each token still computed on its own); in bf16 on other CPUs, to the per-token decode kernel (torch's
bf16 bmm is slow there and its result depends on the bucket's shape). Otherwise (fp32) prefill tokens
are grouped by slot; slots are bucketed by their token count (1, <= 8, more) so that a bucket pads each
slot's tokens to at most a few times their number, and each bucket runs as batched matmuls over its
slots: one shrink per fused group and one expand per module, read in place when the bucket's tokens are
one run of rows, gathered otherwise. Without a C compiler decode tokens take the matmul path too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu import lora as c_lora
from kernels.cpu.decoder import DecoderLora
from kernels.cpu.gemm import GemmLora
from kernels.cpu.slots import CpuLoraSlots as LoraSlots
from kernels.reference.slots import GROUPS

BUCKET_LIMITS = (1, 8)


def use_c_kernel(slots: LoraSlots) -> bool:
    """Whether decode tokens take the C kernel (tests switch it off to check the matmul path)."""
    return c_lora.supports(slots.dtype) and c_lora.fits(slots.max_rank, slots.max_in)


def fuse_into_gemm(slots: LoraSlots) -> bool:
    """Whether decode tokens' LoRA runs inside the C base GEMM (bf16 with AVX512-BF16): the adapters'
    bytes are then read while the GEMM computes instead of in memory-bound passes of their own."""
    return use_c_kernel(slots) and c_lora.supports_fused(slots.dtype)


def _per_token_prefill(slots: LoraSlots) -> bool:
    """Whether prefill tokens, too, go to the per-token C kernel: bf16 where no segment kernel runs."""
    return slots.dtype == torch.bfloat16 and not c_lora.supports_segments(slots.dtype)


@dataclass
class Bucket:
    slots: slice | torch.Tensor   # which slots: a contiguous range, or an index tensor
    tokens: torch.Tensor          # [Sb, Tb] token rows per slot, padded with row 0
    valid: torch.Tensor           # [n_valid] positions in the padded [Sb * Tb] that are real tokens
    targets: torch.Tensor         # [n_valid] token rows the valid positions add into (distinct)
    rows: slice | None = None     # set when the padded [Sb * Tb] tokens are exactly these rows, in order


class LoraBatch:
    """Implements kernels.backend.LoraStep for one step."""

    def __init__(self, slots: LoraSlots, buckets: list[Bucket], decode: c_lora.LoraDecode | None, rank: int,
                 groups: set[str], segments: c_lora.LoraSegments | None = None,
                 fused_rows: c_lora.LoraRows | None = None):
        self.slots = slots
        self.buf = slots.buf
        self.weights = slots.c_weights
        self.buckets = buckets       # prefill tokens (and decode tokens without the C kernel)
        self.decode = decode         # decode tokens, through the C kernel
        self.segments = segments     # prefill tokens through the C segment kernel (bf16), instead of buckets
        self.fused_rows = fused_rows  # decode tokens again, for base GEMMs that compute their LoRA (see fused)
        self.rank = rank
        self.groups = groups         # groups no active adapter targets are skipped entirely
        self._decoder_lora: DecoderLora | None | bool = False   # for_decoder(), computed once

    @classmethod
    def build(cls, slots: LoraSlots, token_slots: list[int], num_decode: int = 0) -> "LoraBatch | None":
        """token_slots[t]: slot of token t, -1 for base-model tokens; the first num_decode tokens are
        decode tokens (one per request)."""
        adapter_of = slots.adapter_of_slot()
        active = {adapter_of[s] for s in set(token_slots) if s >= 0}
        if not active:
            return None
        slot_rank = {s: slots.rank_of[a] for a, s in slots.slot_of.items()}
        decode = fused_rows = None
        if use_c_kernel(slots):
            # NOTE: bf16 prefill tokens with no segment kernel here take the per-token C kernel too:
            # torch's bf16 bmm has no native kernel on such CPUs (slow) and blocks by batch shape.
            per_token = len(token_slots) if _per_token_prefill(slots) else num_decode
            pairs = [(t, s) for t, s in enumerate(token_slots[:per_token]) if s >= 0]
            if pairs:
                index = (torch.tensor([t for t, _ in pairs]), torch.tensor([s for _, s in pairs]),
                         torch.tensor([slot_rank[s] for _, s in pairs]))
                decode = c_lora.LoraDecode(*index, slots.dtype)
                if fuse_into_gemm(slots):
                    fused_rows = c_lora.LoraRows(*index, len(token_slots))
            first = per_token
        else:
            first = 0
        per_slot: dict[int, list[int]] = {}
        for t in range(first, len(token_slots)):
            if token_slots[t] >= 0:
                per_slot.setdefault(token_slots[t], []).append(t)
        rank = max(slots.rank_of[a] for a in active)
        targeted = slots.groups_of(active)
        if per_slot and use_c_kernel(slots) and c_lora.supports_segments(slots.dtype):
            return cls(slots, [], decode, rank, targeted, _segments(per_slot, slot_rank, slots.dtype), fused_rows)
        groups: dict[int, list[int]] = {}
        for s, toks in sorted(per_slot.items()):
            cls_ = next((i for i, lim in enumerate(BUCKET_LIMITS) if len(toks) <= lim), len(BUCKET_LIMITS))
            groups.setdefault(cls_, []).append(s)
        buckets = [_bucket(g, per_slot) for g in groups.values()]
        return cls(slots, buckets, decode, rank, targeted, fused_rows=fused_rows)

    def project(self, linear, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        """linear(x) plus the deltas: decode tokens' inside the C GEMM where it can (fused), the rest after."""
        fused = self.fused(layer, group) if linear.takes_lora else None
        y = linear(x, fused)
        self.apply(layer, group, x, y, fused=fused is not None)
        return y

    def for_decoder(self) -> DecoderLora | None:
        """The step's adapters for the one-call C decoder, or None when some delta needs the Python path."""
        if self._decoder_lora is False:
            self._decoder_lora = self._for_decoder()
        return self._decoder_lora

    def _for_decoder(self) -> DecoderLora | None:
        # decode tokens inside the GEMMs, prefill tokens by segment: the C decoder runs both
        if self.buckets or (self.decode is not None and self.fused_rows is None):
            return None
        if not all(self.weights(0, g).paired and self.weights(0, g).fusable for g in self.groups):
            return None
        rows = self.fused_rows
        return DecoderLora(rows.row_slot if rows else None, rows.row_rank if rows else None, self.segments,
                           lambda layer, group: self.weights(layer, group) if group in self.groups else None)

    def fused(self, layer: int, group: str) -> GemmLora | None:
        """The decode tokens' LoRA for a C base GEMM to compute itself (c_gemm.GemmLora), or None; after
        such a GEMM, apply(..., fused=True) adds only the other tokens' deltas."""
        if self.fused_rows is None or group not in self.groups:
            return None
        w = self.weights(layer, group)
        return self.fused_rows(w) if w.fusable else None

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, fused: bool = False) -> None:
        if group not in self.groups:
            return
        if self.decode is not None and not fused:
            self.decode(x, y, self.weights(layer, group))
        if self.segments is not None:
            self.segments(x, y, self.weights(layer, group))
        a_name, b_names, _ = GROUPS[group]
        for bk in self.buckets:
            self._apply_matmul(layer, a_name, b_names, bk, x, y)

    def _apply_matmul(self, layer, a_name, b_names, bk: Bucket, x: torch.Tensor, y: torch.Tensor) -> None:
        r, g = self.rank, len(b_names)
        sb, tb = bk.tokens.shape
        if bk.rows is not None:        # a dense run of rows: read x and add into y in place
            xp = x[bk.rows].view(sb, tb, -1)
        else:
            xp = torch.index_select(x, 0, bk.tokens.flatten()).view(sb, tb, -1)          # [Sb, Tb, in]
        a = self.buf[a_name][layer, bk.slots][:, :r]                                    # [Sb, r, g, in]
        # NOTE: x @ A^T (weights as the transposed operand) streams A about twice as fast as A @ x^T.
        v = torch.bmm(xp, a.flatten(1, 2).transpose(1, 2)).view(sb, tb, r, g)           # [Sb, Tb, r, g]
        if bk.rows is not None:
            yv, col = y[bk.rows].view(sb, tb, -1), 0
            for i, b in enumerate(b_names):
                w = self.slots.b_rows(b, layer, bk.slots, r)                            # [Sb, r, out_i]
                # NOTE: baddbmm_ into the strided column block of y: no [Sb, Tb, out_i] temporary
                # (measured 2.5x faster than bmm + add).
                yv[:, :, col:col + w.shape[2]].baddbmm_(v[..., i], w)
                col += w.shape[2]
            return
        outs = [torch.bmm(v[..., i], self.slots.b_rows(b, layer, bk.slots, r))          # [Sb, Tb, out_i]
                for i, b in enumerate(b_names)]
        out = outs[0] if g == 1 else torch.cat(outs, dim=2)
        out = torch.index_select(out.reshape(sb * tb, -1), 0, bk.valid)                # [n_valid, out]
        # NOTE: targets are distinct within a bucket, so gather-add-scatter is exact (and much faster
        # than index_add_ on CPU).
        y.index_copy_(0, bk.targets, torch.index_select(y, 0, bk.targets) + out)


def _segments(per_slot: dict[int, list[int]], slot_rank: dict[int, int], dtype: torch.dtype) -> c_lora.LoraSegments:
    order = sorted(per_slot)
    tokens = [t for s in order for t in per_slot[s]]
    starts = [0]
    for s in order:
        starts.append(starts[-1] + len(per_slot[s]))
    return c_lora.LoraSegments(torch.tensor(tokens), torch.tensor(starts), torch.tensor(order),
                               torch.tensor([slot_rank[s] for s in order]), dtype)


def _bucket(group: list[int], per_slot: dict[int, list[int]]) -> Bucket:
    """A dense enough run of slots is read in place as a range (idle slots in it get no tokens);
    a sparse one is gathered (a copy of those slots' weights)."""
    lo, hi = group[0], group[-1] + 1
    if hi - lo <= 2 * len(group):
        members = set(group)   # NOTE: slots of other buckets inside the range get no tokens here
        slots, token_lists = slice(lo, hi), [per_slot[s] if s in members else [] for s in range(lo, hi)]
    else:
        slots, token_lists = torch.tensor(group), [per_slot[s] for s in group]
    width = max(len(t) for t in token_lists)
    tokens = torch.zeros(len(token_lists), width, dtype=torch.long)
    valid = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for i, toks in enumerate(token_lists):
        tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        valid[i, : len(toks)] = True
    valid = valid.flatten()
    flat = tokens.flatten()
    rows = None
    if bool(valid.all()) and torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + len(flat))):
        rows = slice(int(flat[0]), int(flat[0]) + len(flat))
    return Bucket(slots, tokens, valid.nonzero().flatten(), flat[valid], rows)
