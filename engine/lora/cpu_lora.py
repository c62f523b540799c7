"""Multi-LoRA on CPU: y[t] += scale(a_t) * B(a_t) @ (A(a_t) @ x[t]) for every token t, in batched matmuls.

Tokens are grouped by slot once per step (`LoraBatch.build`); every layer then runs, per bucket of
slots, one shrink matmul per fused group and one expand matmul per module, with no loop over adapters.
Slots with few tokens (decodes) form one bucket read as a contiguous range of the slot buffers; slots
with many tokens (prefill segments) form another, gathered, so short and long segments are not padded
to each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.lora.slots import LoraSlots

SMALL_SEGMENT = 8

# fused group -> (A buffer, B buffers in output order)
GROUPS = {"qkv": ("a_qkv", ("b_q", "b_k", "b_v")), "o": ("a_o", ("b_o",)),
          "gate_up": ("a_gu", ("b_g", "b_u")), "down": ("a_d", ("b_d",))}


@dataclass
class Bucket:
    slots: slice | torch.Tensor   # which slots: a contiguous range, or an index tensor
    tokens: torch.Tensor          # [Sb, Tb] token rows per slot, padded with row 0
    valid: torch.Tensor           # [Sb * Tb] bool: which padded positions are real tokens
    targets: torch.Tensor         # [n_valid] token rows the valid positions add into


class LoraBatch:
    """Implements the model's LoraHook for one step."""

    def __init__(self, slots: LoraSlots, buckets: list[Bucket], rank: int):
        self.buf = slots.buf
        self.buckets = buckets
        self.rank = rank

    @classmethod
    def build(cls, slots: LoraSlots, token_slots: list[int], token_adapters: list[int]) -> "LoraBatch | None":
        """token_slots[t]: slot of token t, -1 for base-model tokens."""
        per_slot: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                per_slot.setdefault(s, []).append(t)
        if not per_slot:
            return None
        rank = max(slots.rank_of[a] for a in set(token_adapters) if a > 0)
        small = sorted(s for s, toks in per_slot.items() if len(toks) <= SMALL_SEGMENT)
        large = sorted(s for s, toks in per_slot.items() if len(toks) > SMALL_SEGMENT)
        buckets = []
        if small:
            lo, hi = small[0], small[-1] + 1
            buckets.append(_bucket(slice(lo, hi), [per_slot.get(s, []) for s in range(lo, hi)]))
        if large:
            buckets.append(_bucket(torch.tensor(large), [per_slot[s] for s in large]))
        return cls(slots, buckets, rank)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        a_name, b_names = GROUPS[group]
        r = self.rank
        for bk in self.buckets:
            xp = x[bk.tokens].transpose(1, 2).unsqueeze(1)                 # [Sb, 1, in, Tb]
            a = self.buf[a_name][layer, bk.slots][:, :, :r]                 # [Sb, g, r, in]
            v = torch.matmul(a, xp)                                         # [Sb, g, r, Tb]
            outs = [torch.matmul(self.buf[b][layer, bk.slots][:, :, :r], v[:, i])   # [Sb, out_i, Tb]
                    for i, b in enumerate(b_names)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            out = out.transpose(1, 2).reshape(-1, out.shape[1])[bk.valid]    # [n_valid, out]
            y.index_add_(0, bk.targets, out)


def _bucket(slots, token_lists: list[list[int]]) -> Bucket:
    width = max(len(t) for t in token_lists)
    tokens = torch.zeros(len(token_lists), width, dtype=torch.long)
    valid = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for i, toks in enumerate(token_lists):
        tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        valid[i, : len(toks)] = True
    valid = valid.flatten()
    return Bucket(slots, tokens, valid, tokens.flatten()[valid])
