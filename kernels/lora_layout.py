"""How an adapter is laid out in pages of the unified pool, without padding to any other adapter's rank (the
contract between the adapter loader, which writes it, and the backends, which read it).

A backend chooses its layout with a packer (`Backend.lora_packer`): `plan` places the adapter's matrices in
its flat space, `place` writes one module's weights there. The adapter's flat space is the concatenation
of its pages: element e lives at page `pages[e // page_elems]`, offset `e % page_elems`.

- `LoraPacker` (the Triton and reference backends): for every (layer, module), A [r, in] and then B
  [out, r] row-major, one after another, in sorted (layer, module) order (`PackedLayout.modules`).
- kernels/cpu/lora_pack.py (the CPU backend): per (layer, fused group) blocks in its C kernels' own layout,
  none crossing a page (`PackedLayout.blocks`), so that its kernels read them in place by pointer.

A DoRA adapter (engine/lora/dora.py) also holds, after everything a packer placed (`with_dora`), one vector
per (layer, fused group) it adapts: g - 1 for each of the group's output rows, [out of the group], 0 for the
rows of projections it does not adapt; each vector inside one page (`PackedLayout.dora`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# (layer, module) -> (rank, in, out, scale): what a packer plans from (the weights are not needed)
Shapes = dict[tuple[int, str], tuple[int, int, int, float]]

# A mixture-of-experts layer's expert weights as PEFT adapts them (`target_parameters`): one LoRA over the
# stack of E experts, A [E * r, in] (expert e: rows e*r .. e*r + r) and B [out, E * r] (expert e: columns
# k * E + e), its "rank" E * r; always row-major in the flat space, read by engine/model/expert_lora.py
# (the backends' kernels never see them).
EXPERT_MODULES = ("experts.gate_up_proj", "experts.down_proj")

# fused group -> its projections in output order (the fused weights', the GEMMs' and the C decoder's)
GROUP_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}
GROUP_OF = {m: (g, i) for g, mods in GROUP_MODULES.items() for i, m in enumerate(mods)}


def is_expert(module: str) -> bool:
    return module in EXPERT_MODULES


def kernel_modules(layout: "PackedLayout") -> dict[tuple[int, str], "ModuleSlice"]:
    """The layout's projections the backends' LoRA kernels compute (all but the experts')."""
    return {k: s for k, s in layout.modules.items() if not is_expert(k[1])}


@dataclass(frozen=True)
class ModuleSlice:
    a_offset: int         # -1 in layouts that do not store modules row-major (see PackedLayout.blocks)
    b_offset: int
    rank: int
    n_in: int
    n_out: int
    scale: float


@dataclass(frozen=True)
class GroupBlock:
    """One (layer, fused group) of an adapter in the CPU kernels' layout: A at a_offset, [rank, G, in]
    (row (k, g) is rank k of output g); each output's Bt (B transposed, times the module's scale) at
    b_offsets[g], [rank, out_g] or, paired, [ceil(rank / 2), out_g, 2]; -1 for an output the adapter lacks
    (its A rows are zero). Ranks below `rank` are zero rows."""
    a_offset: int
    b_offsets: tuple[int, ...]
    rank: int


@dataclass(frozen=True)
class PackedLayout:
    modules: dict[tuple[int, str], ModuleSlice]   # (layer, module name, e.g. "q_proj") -> where it lies
    num_elems: int
    blocks: dict[tuple[int, str], GroupBlock] = field(default_factory=dict)   # (layer, group) -> its block
    # (first element, count) of each range that the packer leaves unwritten and the kernels read as zeros
    # (ranks below a block's rank, a group's missing projection): what a packer that writes into reused
    # pages zeroes first (blocks layouts only; the bytes between blocks are never read)
    gaps: tuple[tuple[int, int], ...] = ()
    # DoRA: (layer, group) -> (first element, count) of its vector of g - 1 (see the module doc)
    dora: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    def num_pages(self, page_elems: int) -> int:
        return -(-self.num_elems // page_elems)

    @functools.cached_property
    def has_experts(self) -> bool:
        """Whether it holds a LoRA of experts (looked up every step of a mixture-of-experts model)."""
        return any(is_expert(module) for _, module in self.modules)


DORA_ALIGN = 32     # elements: a DoRA vector starts 64-byte aligned (in bf16)


def with_dora(layout: PackedLayout, sizes: dict[tuple[int, str], int], page_elems: int) -> PackedLayout:
    """The layout with a DoRA vector of sizes[(layer, group)] elements per group, placed after everything
    else, in sorted order, each moved to the next page's start when it would cross into it (the kernels read
    a vector from one page: Backend.dora_scale)."""
    off = layout.num_elems
    dora = {}
    for key in sorted(sizes):
        n = sizes[key]
        if n > page_elems:
            raise ValueError(f"adapter: its DoRA scales of layer {key[0]}'s {key[1]} are {n} elements, more than "
                             f"one page of the pool holds ({page_elems}); raise the block size")
        off = -(-off // DORA_ALIGN) * DORA_ALIGN
        if off // page_elems != (off + n - 1) // page_elems:
            off = -(-off // page_elems) * page_elems
        dora[key] = (off, n)
        off += n
    return dataclasses.replace(layout, num_elems=off, dora=dora)


def flat_slices(page_elems: int, pages: Sequence[int], first: int, count: int) -> list[tuple[int, int, int]]:
    """Elements [first, first + count) of an adapter's flat space as pieces of the pool's flat storage:
    [(storage element, element of the range, length)], one per page it touches."""
    out = []
    e = first
    while e < first + count:
        n = min(first + count - e, page_elems - e % page_elems)
        out.append((pages[e // page_elems] * page_elems + e % page_elems, e - first, n))
        e += n
    return out


def write_range(storage: torch.Tensor, pages: Sequence[int], first: int, values: torch.Tensor) -> None:
    """values [count] (converted to the storage's dtype) -> elements [first, first + count) of the flat space
    whose pages in the pool storage [num_pages, page_elems] are `pages`."""
    flat = storage.view(-1)
    for at, i, n in flat_slices(storage.shape[1], pages, first, values.numel()):
        flat[at:at + n].copy_(values[i:i + n])


class LoraPacker:
    """The row-major layout above. `zero_fill`: whether the packed space must start zeroed (gaps, padding)."""
    zero_fill = False

    def plan(self, shapes: Shapes, page_elems: int) -> PackedLayout:
        off = 0
        mods = {}
        for key in sorted(shapes):
            r, n_in, n_out, scale = shapes[key]
            mods[key] = ModuleSlice(off, off + r * n_in, r, n_in, n_out, scale)
            off += r * (n_in + n_out)
        return PackedLayout(mods, off)

    def can_pack_file(self, dtypes, dtype: torch.dtype) -> bool:
        """Whether pack_file reads tensors of these safetensors dtypes into `dtype` here: the CPU backend's C
        packer (kernels/cpu/lora_pack.py), which also writes this layout (each tensor one converted run)."""
        from kernels.cpu import lora_pack
        return lora_pack.can_pack_file(dtypes, dtype)

    def pack_file(self, layout: PackedLayout, where, address: int, flat: torch.Tensor, pace,
                  pages: Sequence[int] | None = None, helper=None) -> tuple | None:
        """Every tensor straight from the file mapped at `address` into `flat` (or its rows `pages`), the
        bits of place(); see GroupPacker.pack_file. Used by the loader for a GPU's staging rows and a CPU
        pool under this layout; -> None, or the (key, name) of the first tensor holding NaN or infinity."""
        from kernels.cpu import lora_pack
        return lora_pack.ROW_MAJOR.pack_file(layout, where, address, flat, pace, pages, helper)

    def place(self, layout: PackedLayout, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor,
              flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Write one module's A [r, in] and B [out, r] (any float dtype; converted to flat's) into the flat
        space -> [(name, values as stored)] for the caller's checks (NaN, infinity)."""
        s = layout.modules[key]
        out = []
        for name, t, off in (("lora_A", a, s.a_offset), ("lora_B", b, s.b_offset)):
            dst = flat[off:off + t.numel()]
            dst.copy_(t.flatten())
            out.append((name, dst))
        return out


def unpack_module(flat: torch.Tensor, s: ModuleSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """flat: the adapter's pages gathered in order, flattened -> views A [r, in], B [out, r]."""
    a = flat[s.a_offset:s.a_offset + s.rank * s.n_in].view(s.rank, s.n_in)
    b = flat[s.b_offset:s.b_offset + s.rank * s.n_out].view(s.n_out, s.rank)
    return a, b
