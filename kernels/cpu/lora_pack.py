"""The CPU backend's layout of an adapter in the pool's pages: per (layer, fused group) one block its C
kernels read in place by pointer (kernels/lora_layout.py: GroupBlock), each block inside one page.

An adapter of rank R (its largest module rank; smaller modules' extra ranks are zero rows) stores, for each
layer and fused group it targets: A [R, G, in] rank-major (the G projections' rows of rank k side by side,
as one shrink reads them) and, per projection it has, Bt = (B * scale)^T, [R, out] or, where the bf16 C
kernels take it so (AVX512-BF16: `lora.pairs_b`), paired [ceil(R / 2), out, 2]. B is scaled in the model
dtype after conversion, as PEFT's bf16 model computes scale * (B (A x)) up to that rounding; the CPU kernels
were always fed this way. Blocks are placed first-fit, largest first, 64-byte aligned, so a page holds
several and none crosses a page boundary; an adapter's bytes are its own rank's, never another's.
"""
from __future__ import annotations

import torch

from kernels.cpu import lora as c_lora
from kernels.lora_layout import GroupBlock, ModuleSlice, PackedLayout, Shapes

# fused group -> its projections in output order (decoder.c's and the GEMMs' order)
GROUP_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}
GROUP_OF = {m: (g, i) for g, mods in GROUP_MODULES.items() for i, m in enumerate(mods)}
ALIGN = 32   # elements: 64 bytes in bf16


class GroupPacker:
    zero_fill = True          # ranks below an adapter's rank and missing projections are zero rows

    def __init__(self, dtype: torch.dtype):
        self.paired = c_lora.pairs_b(dtype)

    def b_elems(self, rank: int, out: int) -> int:
        return ((rank + 1) // 2) * 2 * out if self.paired else rank * out

    def plan(self, shapes: Shapes, page_elems: int) -> PackedLayout:
        R = max(r for r, *_ in shapes.values())
        groups: dict[tuple[int, str], dict[int, tuple[int, int]]] = {}    # (layer, group) -> {index: (in, out)}
        for (layer, module), (_, n_in, n_out, _) in shapes.items():
            g, i = GROUP_OF[module]
            groups.setdefault((layer, g), {})[i] = (n_in, n_out)
        pieces = []                                          # (elements, (layer, group), 'a' or output index)
        for key, outs in groups.items():
            n_in = next(iter(outs.values()))[0]
            pieces.append((R * len(GROUP_MODULES[key[1]]) * n_in, key, "a"))
            pieces += [(self.b_elems(R, n_out), key, i) for i, (_, n_out) in outs.items()]
        offsets, used = self._place(pieces, page_elems)
        blocks = {}
        for key, outs in groups.items():
            b = tuple(offsets.get((key, i), -1) for i in range(len(GROUP_MODULES[key[1]])))
            blocks[key] = GroupBlock(offsets[(key, "a")], b, R)
        modules = {k: ModuleSlice(-1, -1, r, n_in, n_out, scale) for k, (r, n_in, n_out, scale) in shapes.items()}
        return PackedLayout(modules, used, blocks)

    @staticmethod
    def _place(pieces, page_elems: int) -> tuple[dict, int]:
        """First fit, largest first: -> ({(key, part): flat offset}, elements spanned)."""
        free: list[int] = []                                 # next free element of each page
        offsets = {}
        for n, key, part in sorted(pieces, key=lambda p: (-p[0], p[1], str(p[2]))):
            if n > page_elems:
                raise ValueError(f"adapter: its {key[1]} LoRA of layer {key[0]} is {n} elements, more than one page "
                                 f"of the pool holds ({page_elems}); raise the block size")
            page = next((i for i, f in enumerate(free) if f + n <= page_elems), None)
            if page is None:
                free.append(0)
                page = len(free) - 1
            offsets[(key, part)] = page * page_elems + free[page]
            free[page] = min(page_elems, -(-(free[page] + n) // ALIGN) * ALIGN)
        return offsets, (len(free) - 1) * page_elems + free[-1]

    def place(self, layout: PackedLayout, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor,
              flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """a [r, in], b [out, r] in any float dtype -> their rows of the module's group block (flat zeroed)."""
        layer, module = key
        g, i = GROUP_OF[module]
        blk = layout.blocks[(layer, g)]
        G, R = len(GROUP_MODULES[g]), blk.rank
        r, n_in = a.shape
        a = a.to(flat.dtype)
        flat[blk.a_offset:blk.a_offset + R * G * n_in].view(R, G, n_in)[:r, i].copy_(a)
        b = b.to(flat.dtype)
        bt = (b * layout.modules[key].scale).T                          # [r, out]
        n = self.b_elems(R, bt.shape[1])
        dst = flat[blk.b_offsets[i]:blk.b_offsets[i] + n]
        if self.paired:
            dst.view(-1, bt.shape[1], 2)[: (r + 1) // 2].copy_(c_lora.pair_rows(bt))
        else:
            dst.view(R, -1)[:r].copy_(bt)
        return [("lora_A", a), ("lora_B", b)]
