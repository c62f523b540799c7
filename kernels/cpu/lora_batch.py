"""Multi-LoRA on CPU (the CPU backend's LoraStep): y[t] += scale(a_t) * B(a_t) @ (A(a_t) @ x[t]) for every
token t, reading each adapter in place in the pool's pages (kernels/cpu/paged_adapters.py), with no loop
over adapters in Python.

Tokens are grouped once per step (`LoraBatch.build`); the step's distinct adapters become "slots" 0..S-1 of
its pointer tables (lora.Weights). Decode tokens (the first `num_decode`, one per request) go to the C kernel
(kernels/cpu/csrc/lora.c): one task per token that streams its adapter's own rank of A and B once, in fp32, so
a decode token's delta never depends on who shares the step or its adapter. In bf16 with the AVX512-BF16 C
GEMM, the GEMM computes those tokens' LoRA itself (`fused`, kernels/cpu/csrc/gemm_lora_avx512bf16.c): the
adapters' bytes stream in while it computes (on AVX2 the decode kernel after the GEMM measured faster).
In bf16 with AVX512-BF16 or AVX2, prefill tokens go to the segment kernel (tokens grouped by adapter, 4 at a
time per weight load, each token still computed on its own); otherwise (fp32, or bf16 on other CPUs) to the
per-token kernel. Where AMX tiles run (c_lora.segments_on_amx), every token goes to the segment kernel, decode
tokens grouped by adapter with the prefill ones: it runs up to 16 tokens of an adapter per AMX task
(kernels/cpu/csrc/lora_amx.h), so an adapter that 20 requests share is read twice a step, not 20 times, and
its FLOPs run at AMX's rate. Ranks or widths beyond what the C kernels were compiled for take a plain torch
loop over the step's adapters (`fallback`).
"""
from __future__ import annotations

import torch

from kernels.cpu import lora as c_lora
from kernels.cpu.decoder import DecoderLora
from kernels.cpu.gemm import GemmLora
from kernels.cpu.paged_adapters import CpuPagedAdapters


def use_c_kernel(adapters: CpuPagedAdapters) -> bool:
    """Whether the C kernels take the step's LoRA (else the torch fallback; tests switch it off)."""
    return c_lora.supports(adapters.dtype) and c_lora.fits(adapters.max_rank, adapters.max_in)


def fuse_into_gemm(adapters: CpuPagedAdapters) -> bool:
    """Whether decode tokens' LoRA runs inside the C base GEMM (bf16, AVX512-BF16): the adapters' bytes are
    then read while the GEMM computes instead of in memory-bound passes of their own."""
    return use_c_kernel(adapters) and c_lora.supports_fused(adapters.dtype)


class LoraBatch:
    """Implements kernels.backend.LoraStep for one step."""

    def __init__(self, adapters: CpuPagedAdapters, tables, rank: int, groups: set[str],
                 decode: c_lora.LoraDecode | None = None, segments: c_lora.LoraSegments | None = None,
                 fused_rows: c_lora.LoraRows | None = None, fallback: list | None = None):
        self.adapters = adapters
        self.tables = tables         # the step's pointer tables (CpuPagedAdapters.tables)
        self.rank = rank             # the largest rank among the step's adapters
        self.groups = groups         # groups no active adapter targets are skipped entirely
        self.decode = decode         # decode tokens (and prefill tokens without a segment kernel), C kernel
        self.segments = segments     # prefill tokens through the C segment kernel (bf16)
        self.fused_rows = fused_rows  # decode tokens again, for base GEMMs that compute their LoRA (see fused)
        self.fallback = fallback     # [(slot, token rows)] for the torch loop, when the C kernels cannot
        self._weights: dict[tuple[int, str], c_lora.Weights] = {}
        self._decoder_lora: DecoderLora | None | bool = False   # for_decoder(), computed once

    @classmethod
    def build(cls, adapters: CpuPagedAdapters, token_slots: list[int], num_decode: int = 0) -> "LoraBatch | None":
        """token_slots[t]: slot of token t, -1 for base-model tokens; the first num_decode tokens are
        decode tokens (one per request)."""
        slots = sorted({s for s in token_slots if s >= 0})
        if not slots:
            return None
        adapter_of = adapters.adapter_of_slot()
        ranks = [adapters.rank_of[adapter_of[s]] for s in slots]
        groups = adapters.groups_of(adapter_of[s] for s in slots)
        if not use_c_kernel(adapters):
            rows: dict[int, list[int]] = {}
            for t, s in enumerate(token_slots):
                if s >= 0:
                    rows.setdefault(s, []).append(t)
            return cls(adapters, None, max(ranks), groups, fallback=[(s, torch.tensor(r)) for s, r in rows.items()])
        index = {s: j for j, s in enumerate(slots)}
        tables = adapters.tables(slots)
        segmented = c_lora.supports_segments(adapters.dtype)
        # decode tokens one at a time (inside the GEMM where it can), or by adapter in the segments (on AMX)
        per_token = 0 if c_lora.segments_on_amx(adapters.dtype) else num_decode if segmented else len(token_slots)
        pairs = [(t, index[s], ranks[index[s]]) for t, s in enumerate(token_slots[:per_token]) if s >= 0]
        decode = fused_rows = segments = None
        if pairs:
            cols = [torch.tensor(c) for c in zip(*pairs)]
            decode = c_lora.LoraDecode(*cols, adapters.dtype)
            if fuse_into_gemm(adapters):
                fused_rows = c_lora.LoraRows(*cols, len(token_slots))
        per_slot: dict[int, list[int]] = {}
        for t in range(per_token, len(token_slots)):
            if token_slots[t] >= 0:
                per_slot.setdefault(index[token_slots[t]], []).append(t)
        if per_slot:
            segments = _segments(per_slot, ranks, adapters.dtype)
        return cls(adapters, tables, max(ranks), groups, decode, segments, fused_rows)

    def weights(self, layer: int, group: str) -> c_lora.Weights:
        key = (layer, group)
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = self.adapters.weights(self.tables, layer, group, self.rank)
        return w

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
        if self.fallback is not None or (self.decode is not None and self.fused_rows is None):
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
        if self.fallback is not None:
            return self._apply_torch(layer, group, x, y)
        if self.decode is not None and not fused:
            self.decode(x, y, self.weights(layer, group))
        if self.segments is not None:
            self.segments(x, y, self.weights(layer, group))

    def _apply_torch(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Per adapter of the step: y[rows] += (x[rows] A^T) Bt, in fp32, rounded once."""
        for slot, rows in self.fallback:
            blk = self.adapters.block(slot, layer, group)
            if blk is None:
                continue
            a, bs = blk
            R, G, n_in = a.shape
            v = (x[rows].float() @ a.reshape(R * G, n_in).float().T).view(len(rows), R, G)
            delta = torch.cat([v[..., g] @ b.float() for g, b in enumerate(bs)], dim=1)
            y[rows] = (y[rows].float() + delta).to(y.dtype)


def _segments(per_slot: dict[int, list[int]], ranks: list[int], dtype: torch.dtype) -> c_lora.LoraSegments:
    order = sorted(per_slot)
    tokens = [t for s in order for t in per_slot[s]]
    starts = [0]
    for s in order:
        starts.append(starts[-1] + len(per_slot[s]))
    return c_lora.LoraSegments(torch.tensor(tokens), torch.tensor(starts), torch.tensor(order),
                               torch.tensor([ranks[s] for s in order]), dtype)

