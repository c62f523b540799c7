"""Several adapters on one request, each with a weight: W x + sum_i w_i s_i B_i A_i x (s_i: its alpha / r).

A composition is one derived adapter in PEFT's "cat" form (`add_weighted_adapter(combination_type="cat")`):
for each module, A is the members' A stacked by rank, each times w_i s_i (in the file's dtype, as PEFT
scales them), B the members' B side by side, the scale 1; its rank is the sum of theirs. It is computed in
the mixed batch like any adapter, by every backend's kernels, at its own rank: the members are added, never
merged into the base weights or into fewer ranks. Its pages hold a copy of its members' weights, packed
by the loader from their files (like any load, beside the steps); a request names its members, and the
AdapterManager keeps one derived adapter per (members' ids, weights), so its prefix-cache blocks are keyed
by the whole composition and it is dropped with any member that goes away.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from engine.lora.host_adapter import AdapterFiles, read_weights

MAX_WEIGHT = 10.0         # |w_i| at most this
MAX_KEPT = 1024           # compositions known at once; beyond, the least recently asked idle one is forgotten


def check_members(members: Sequence[tuple[str, float]], max_members: int) -> None:
    """A composition as a request names it: ValueError naming what is wrong."""
    if not members:
        raise ValueError("adapters: at least one adapter is required")
    if len(members) > max_members:
        raise ValueError(f"adapters: {len(members)} adapters on one request; at most {max_members} "
                         f"(--max-adapters-per-request)")
    names = [n for n, _ in members]
    if len(set(names)) != len(names):
        raise ValueError(f"adapters: each adapter at most once (got {names})")
    for name, w in members:
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or abs(w) > MAX_WEIGHT:
            raise ValueError(f"adapters: the scale of {name!r} must be a finite number in [-{MAX_WEIGHT:g}, "
                             f"{MAX_WEIGHT:g}], got {w!r}")


def display_name(members: Sequence[tuple[str, float]]) -> str:
    return " + ".join(f"{w:g} * {n}" for n, w in members)


class ComposedFiles:
    """The AdapterFiles of a composition (what the loader reads): `module_shapes` plans its pages, `read`
    yields its modules. Never packed straight from a file (`where` is empty)."""

    def __init__(self, members: Sequence[tuple[AdapterFiles, float]]):
        self.members = list(members)
        self.where: dict = {}
        self.path = self.members[0][0].path
        shapes: dict[tuple[int, str], tuple[int, int, int, float]] = {}
        for files, _ in self.members:
            for key, (r, n_in, n_out, _) in files.shapes.items():
                shapes[key] = (shapes.get(key, (0,))[0] + r, n_in, n_out, 1.0)
        self.shapes = shapes

    def module_shapes(self) -> dict[tuple[int, str], tuple[int, int, int, float]]:
        return self.shapes

    @property
    def rank(self) -> int:
        return max(r for r, *_ in self.shapes.values())

    @property
    def nbytes(self) -> int:
        return sum(files.nbytes for files, _ in self.members)

    def read(self) -> Iterator[tuple[tuple[int, str], torch.Tensor, torch.Tensor]]:
        """((layer, module), A [sum r, in], B [out, sum r]) for every module any member adapts."""
        parts: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for files, w in self.members:
            for key, a, b in read_weights(files):
                parts.setdefault(key, []).append((a * (w * files.shapes[key][3]), b))
        for key in sorted(parts):
            ab = parts[key]
            dtype = ab[0][0].dtype
            for a, b in ab:
                dtype = torch.promote_types(torch.promote_types(dtype, a.dtype), b.dtype)
            yield key, torch.cat([a.to(dtype) for a, _ in ab]), torch.cat([b.to(dtype) for _, b in ab], dim=1)
