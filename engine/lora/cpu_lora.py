"""Multi-LoRA on CPU: y[t] += scale(a_t) * B(a_t) @ (A(a_t) @ x[t]) for every token t, in batched matmuls.

Tokens are grouped by slot once per step (`LoraBatch.build`); every layer then runs, per bucket of
slots, one shrink matmul per fused group and one expand matmul per module, with no loop over adapters.
Slots are bucketed by their token count (1, <= 4, <= 16, more) so that a bucket pads each slot's tokens
to at most a few times their number; a dense run of slots is read in place, a sparse one gathered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.lora.slots import LoraSlots

BUCKET_LIMITS = (1, 8)

# fused group -> (A buffer, B buffers in output order, the projections they hold)
GROUPS = {"qkv": ("a_qkv", ("b_q", "b_k", "b_v"), ("q_proj", "k_proj", "v_proj")), "o": ("a_o", ("b_o",), ("o_proj",)),
          "gate_up": ("a_gu", ("b_g", "b_u"), ("gate_proj", "up_proj")), "down": ("a_d", ("b_d",), ("down_proj",))}


@dataclass
class Bucket:
    slots: slice | torch.Tensor   # which slots: a contiguous range, or an index tensor
    tokens: torch.Tensor          # [Sb, Tb] token rows per slot, padded with row 0
    valid: torch.Tensor           # [n_valid] positions in the padded [Sb * Tb] that are real tokens
    targets: torch.Tensor         # [n_valid] token rows the valid positions add into
    rows: slice | None = None     # set when slot lo+i holds exactly token rows.start+i: no gather/scatter


class LoraBatch:
    """Implements the model's LoraHook for one step."""

    def __init__(self, slots: LoraSlots, buckets: list[Bucket], rank: int, modules: frozenset[str]):
        self.buf = slots.buf
        self.buckets = buckets
        self.rank = rank
        # groups no active adapter targets are skipped entirely
        self.groups = {g for g, (_, _, mods) in GROUPS.items() if modules.intersection(mods)}

    @classmethod
    def build(cls, slots: LoraSlots, token_slots: list[int], token_adapters: list[int]) -> "LoraBatch | None":
        """token_slots[t]: slot of token t, -1 for base-model tokens."""
        per_slot: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                per_slot.setdefault(s, []).append(t)
        if not per_slot:
            return None
        active = {a for a in token_adapters if a > 0}
        rank = max(slots.rank_of[a] for a in active)
        modules = frozenset().union(*(slots.modules_of[a] for a in active))
        groups: dict[int, list[int]] = {}
        for s, toks in sorted(per_slot.items()):
            cls_ = next((i for i, lim in enumerate(BUCKET_LIMITS) if len(toks) <= lim), len(BUCKET_LIMITS))
            groups.setdefault(cls_, []).append(s)
        return cls(slots, [_bucket(g, per_slot) for g in groups.values()], rank, modules)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if group not in self.groups:
            return
        a_name, b_names, _ = GROUPS[group]
        r, g = self.rank, len(b_names)
        for bk in self.buckets:
            if bk.rows is not None:
                self._apply_rows(layer, a_name, b_names, bk, x, y)
                continue
            sb, tb = bk.tokens.shape
            xp = torch.index_select(x, 0, bk.tokens.flatten()).view(sb, tb, -1)          # [Sb, Tb, in]
            a = self.buf[a_name][layer, bk.slots][:, :r]                                # [Sb, r, g, in]
            # NOTE: x @ A^T (weights as the transposed operand) streams A about twice as fast as A @ x^T.
            v = torch.bmm(xp, a.flatten(1, 2).transpose(1, 2)).view(sb, tb, r, g)       # [Sb, Tb, r, g]
            if tb == 1:
                # B @ v streams B fastest for one token per slot; [Sb, out, 1] is already row layout.
                outs = [torch.bmm(self.buf[b][layer, bk.slots][:, :, :r], v[..., i].transpose(1, 2))
                        for i, b in enumerate(b_names)]                                 # [Sb, out_i, 1]
                out = outs[0] if g == 1 else torch.cat(outs, dim=1)
            else:
                outs = [torch.bmm(v[..., i], self.buf[b][layer, bk.slots][:, :, :r].transpose(1, 2))
                        for i, b in enumerate(b_names)]                                 # [Sb, Tb, out_i]
                out = outs[0] if g == 1 else torch.cat(outs, dim=2)
            out = torch.index_select(out.reshape(sb * tb, -1), 0, bk.valid)            # [n_valid, out]
            # NOTE: targets are distinct within a bucket, so gather-add-scatter is exact (and much faster
            # than index_add_ on CPU).
            y.index_copy_(0, bk.targets, torch.index_select(y, 0, bk.targets) + out)


    def _apply_rows(self, layer, a_name, b_names, bk: Bucket, x: torch.Tensor, y: torch.Tensor) -> None:
        """One token per slot, tokens in slot order: read x and add into y in place (decode)."""
        r, g = self.rank, len(b_names)
        xp = x[bk.rows].unsqueeze(1)                                                    # [Sb, 1, in]
        a = self.buf[a_name][layer, bk.slots][:, :r]                                    # [Sb, r, g, in]
        v = torch.bmm(xp, a.flatten(1, 2).transpose(1, 2)).view(-1, r, g)             # [Sb, r, g]
        col = 0
        for i, b in enumerate(b_names):
            out = torch.bmm(self.buf[b][layer, bk.slots][:, :, :r], v[:, :, i:i + 1])  # [Sb, out_i, 1]
            n = out.shape[1]
            y[bk.rows, col:col + n] += out.squeeze(2)
            col += n


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
    rows = None
    if isinstance(slots, slice) and width == 1 and bool(valid.all()):
        first = token_lists[0][0]
        if all(t[0] == first + i for i, t in enumerate(token_lists)):
            rows = slice(first, first + len(token_lists))
    return Bucket(slots, tokens, valid.nonzero().flatten(), tokens.flatten()[valid], rows)
