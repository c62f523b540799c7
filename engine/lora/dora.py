"""DoRA adapters (PEFT `use_dora`): a LoRA whose adapted weight is rescaled row by row to a learned magnitude.

A DoRA projection computes  y = g * (W x + s B A x) (+ bias),  g = m / ||W + s B A||_row  per output row:
m is the adapter's magnitude vector [out], the norm is over each row of the adapted weight (PEFT's
DoraLinearLayer, dropout off). g depends on the base weights and the adapter only, so it is computed once,
here, by the loader when it packs the adapter (off the step thread; on a GPU on the loader's own stream), and
stored in the adapter's pages as d = g - 1 per (layer, fused group) (kernels/lora_layout.py: with_dora):
d is small, so a bf16 or int8 copy of it keeps g's deviation from 1 to the precision of d. A step then
scales each DoRA row's fused outputs by 1 + d (engine/model/dora_scales.py), after the backend's LoRA
deltas and before any bias: one multiply per row and group, nothing recomputed per step.

Shapes: W [out, in] in the model dtype on the model's device; A [r, in], B [out, r]; m, g, d [out].
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.lora.host_adapter import AdapterFiles, mapped_weights, module_shape
from engine.lora.peft_config import module_path
from kernels.lora_layout import GROUP_MODULES, GROUP_OF, PackedLayout, with_dora, write_range

BaseWeight = Callable[[int, str], torch.Tensor]     # (layer, projection) -> W [out, in]
PIECE = 1 << 20     # elements of W read at a time (whole projections of a small model; ~0.1 ms here)


def _no_pause() -> None:
    return None


def group_rows(cfg: ModelConfig, module: str) -> tuple[str, int, int]:
    """A projection's fused group and its rows [first, end) of the group's output."""
    group, i = GROUP_OF[module]
    first = sum(module_shape(cfg, m)[1] for m in GROUP_MODULES[group][:i])
    return group, first, first + module_shape(cfg, module)[1]


def group_size(cfg: ModelConfig, group: str) -> int:
    return sum(module_shape(cfg, m)[1] for m in GROUP_MODULES[group])


def plan(layout: PackedLayout, files: AdapterFiles, cfg: ModelConfig, page_elems: int) -> PackedLayout:
    """The adapter's layout with room for its DoRA vectors (unchanged for a plain LoRA adapter)."""
    if not files.magnitudes:
        return layout
    groups = {(layer, GROUP_OF[module][0]) for layer, module in files.magnitudes}
    return with_dora(layout, {(layer, g): group_size(cfg, g) for layer, g in groups}, page_elems)


def read_magnitudes(files: AdapterFiles) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, projection) -> m [out] in float32 (a fused module's pieces: their rows of it)."""
    out = {}
    with safe_open(str(files.weights), framework="pt") as fh:
        for key, name in files.magnitudes.items():
            m = fh.get_tensor(name).float()
            if key in files.rows:
                first, end = files.rows[key]
                m = m[first:end]
            out[key] = m
    return out


class BaseRows:
    """The base model's projections as DoRA's norms read them: weight(layer, module) -> W [out, in], and each
    row's squared norm ||W||^2 [out] in float32, computed at the first use and kept (a few bytes per row).
    Any thread may call it: two threads computing one entry at once store the same value."""

    def __init__(self, weight: BaseWeight):
        self.weight = weight
        self._sq: dict[tuple[int, str], torch.Tensor] = {}

    def sq_norms(self, layer: int, module: str, pace=_no_pause) -> torch.Tensor:
        sq = self._sq.get((layer, module))
        if sq is None:
            w = self.weight(layer, module)
            sq = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
            for lo, hi in _pieces(w):
                pace()
                sq[lo:hi] = w[lo:hi].float().square().sum(1)
            self._sq[(layer, module)] = sq
        return sq


def _pieces(w: torch.Tensor) -> list[tuple[int, int]]:
    rows = max(1, PIECE // w.shape[1])
    return [(lo, min(lo + rows, w.shape[0])) for lo in range(0, w.shape[0], rows)]


def row_norms(base: BaseRows, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scale: float,
              pace=_no_pause) -> torch.Tensor:
    """||W + scale B A|| of each row, as ||W||^2 + 2 scale (B . W A^T) + scale^2 (B (A A^T) . B) summed per row
    in float32 (W read once, in pieces, never converted nor copied: W A^T is a GEMM in the model dtype, in
    float32 for a float32 model), on W's device -> [out] on the host. The sum is of the size of W's row for
    any adapter that does not cancel a row of W, so the expansion loses nothing that float32 keeps; in bf16
    W A^T is rounded as the model's own products are (PEFT forms all of W + s B A in bf16)."""
    w = base.weight(layer, module)
    aw = a.to(w.device, w.dtype)
    a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
    sq = base.sq_norms(layer, module, pace).clone()
    aat = a @ a.T                                                         # [r, r]
    for lo, hi in _pieces(w):
        pace()
        bl = b[lo:hi]
        t = torch.addmm((w[lo:hi] @ aw.T).float(), bl, aat, alpha=scale / 2)    # W A^T + s/2 B A A^T: [rows, r]
        sq[lo:hi].add_(torch.linalg.vecdot(t, bl), alpha=2 * scale)            # + 2 s (B . that), per row
    return sq.clamp_min_(0).sqrt_().cpu()


def scales(files: AdapterFiles, cfg: ModelConfig, base: BaseRows,
           pace=_no_pause) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, group) -> d = g - 1 [out of the group] in float32: every adapted row's m / ||W + s B A|| - 1,
    0 elsewhere. Raises ValueError naming a row whose g is not finite (a zero row of W + s B A)."""
    mags = read_magnitudes(files)
    out: dict[tuple[int, str], torch.Tensor] = {}
    for key, a, b in mapped_weights(files):
        layer, module = key
        group, first, end = group_rows(cfg, module)
        d = mags[key] / row_norms(base, layer, module, a, b, files.shapes[key][3], pace) - 1
        if not torch.isfinite(d).all():
            raise ValueError(f"adapter: {module_path(layer, module)}: DoRA's magnitude over the row norm of "
                             f"W + s B A is not finite (a zero row)")
        out.setdefault((layer, group), torch.zeros(group_size(cfg, group)))[first:end] = d
    return out


def write(layout: PackedLayout, values: dict[tuple[int, str], torch.Tensor], storage: torch.Tensor,
          pages: list[int]) -> None:
    """values (from `scales`) -> their places in the adapter's pages of storage [num_pages, page_elems]."""
    for key, (first, _) in layout.dora.items():
        write_range(storage, pages, first, values[key])
