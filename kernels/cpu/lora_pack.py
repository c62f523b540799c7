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

import ctypes
import itertools
import threading
from typing import NamedTuple

import numpy as np
import torch

from kernels.cpu import lora as c_lora
from kernels.cpu.build import load_functions
from kernels.lora_layout import GROUP_MODULES, GROUP_OF, GroupBlock, ModuleSlice, PackedLayout, Shapes, is_expert

ALIGN = 32   # elements: 64 bytes in bf16
SRC_DTYPES = {"F32": 0, "BF16": 1, "F16": 2}     # file dtypes lora_pack.c reads
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
CHUNK = 1 << 17                                  # elements pack_file writes between two pace() calls
PLANS_KEPT = 64                                  # layouts remembered by shapes (GroupPacker.plan)


class _Piece(ctypes.Structure):
    _fields_ = [("src", ctypes.c_int64), ("dst", ctypes.c_int64), ("rows", ctypes.c_int32), ("cols", ctypes.c_int32),
                ("kind", ctypes.c_int32), ("G", ctypes.c_int32), ("g", ctypes.c_int32), ("src_dtype", ctypes.c_int32),
                ("scale", ctypes.c_float)]


# _Piece as a numpy record (pack_file's tables: built once per recipe, offsets remapped with one vector op)
_PIECE = np.dtype([("src", np.int64), ("dst", np.int64), ("rows", np.int32), ("cols", np.int32),
                   ("kind", np.int32), ("G", np.int32), ("g", np.int32), ("src_dtype", np.int32),
                   ("scale", np.float32)], align=True)
assert _PIECE.itemsize == ctypes.sizeof(_Piece)


class _PieceTable(NamedTuple):
    layout: PackedLayout                     # the table is for this layout object
    pieces: np.ndarray                       # [n] of _PIECE: A, B of each module, in the file's order
    names: list[tuple[tuple[int, str], str]]  # each piece's (layer, module), "lora_A" / "lora_B"
    chunks: list[tuple[int, int]]            # pieces [start, end) of about CHUNK elements: one C call each


def _piece_table(layout: PackedLayout, where, paired: bool) -> _PieceTable:
    rows, names, sizes = [], [], []
    for key, ((da, sa, _), (db, sb, _)) in sorted(where.items()):
        layer, module = key
        g, i = GROUP_OF[module]
        blk = layout.blocks[(layer, g)]
        ms = layout.modules[key]
        G = len(GROUP_MODULES[g])
        rows.append((sa, blk.a_offset, ms.rank, ms.n_in, 0, G, i, SRC_DTYPES[da], 0.0))
        rows.append((sb, blk.b_offsets[i], ms.n_out, ms.rank, 2 if paired else 1, G, i, SRC_DTYPES[db], ms.scale))
        names += [(key, "lora_A"), (key, "lora_B")]
        sizes += [ms.rank * ms.n_in, ms.rank * ms.n_out]
    return _PieceTable(layout, np.array(rows, dtype=_PIECE), names, _chunks(sizes))


def _row_major_table(layout: PackedLayout, where, page_elems: int) -> _PieceTable:
    """The row-major layout's pieces (kernels/lora_layout.py: LoraPacker): each tensor one run of values,
    split where the flat space crosses a page (page_elems; 0: one contiguous space)."""
    rows, names, sizes = [], [], []
    for key, ((da, sa, _), (db, sb, _)) in sorted(where.items()):
        ms = layout.modules[key]
        for name, dt, src, dst, n in (("lora_A", da, sa, ms.a_offset, ms.rank * ms.n_in),
                                      ("lora_B", db, sb, ms.b_offset, ms.rank * ms.n_out)):
            item = ITEMSIZE[dt]
            while n > 0:
                m = n if not page_elems else min(n, page_elems - dst % page_elems)
                rows.append((src, dst, 1, m, 0, 1, 0, SRC_DTYPES[dt], 0.0))
                names.append((key, name))
                sizes.append(m)
                src, dst, n = src + m * item, dst + m, n - m
    return _PieceTable(layout, np.array(rows, dtype=_PIECE), names, _chunks(sizes))


def _chunks(sizes: list[int]) -> list[tuple[int, int]]:
    chunks, start, done = [], 0, 0
    for end in range(1, len(sizes) + 1):
        done += sizes[end - 1]
        if done >= CHUNK or end == len(sizes):
            chunks.append((start, end))
            start, done = end, 0
    return chunks


def run_table(table: _PieceTable, address: int, flat: torch.Tensor, pace, pages: list[int] | None,
              helper) -> tuple | None:
    """Pack `table`'s pieces from the file mapped at `address` into `flat` (its rows `pages` when given: no
    piece crosses a page), pace() before each chunk; while helper.wide(), `helper`'s thread takes chunks too
    (both threads take the next chunk not taken, so neither waits for the other's share) -> None, or the
    (key, name) of the first tensor holding NaN or infinity in flat's dtype (the first in the table's order
    on two threads too: every chunk before a bad one is taken before it and finished before this returns)."""
    pieces = table.pieces
    if pages is not None:                   # flat offsets -> the pages' rows of `flat`
        pe = flat.shape[1]
        pieces = pieces.copy()
        dst = pieces["dst"]
        pieces["dst"] = np.asarray(pages, dtype=np.int64)[dst // pe] * pe + dst % pe
    base, out = pieces.ctypes.data, flat.data_ptr()
    bf16 = int(flat.dtype == torch.bfloat16)
    chunks = table.chunks
    taken = itertools.count()               # the next chunk to pack (next() is atomic: it holds the GIL)
    bad: list[tuple[int, int]] = []         # (chunk, the failing piece) of every chunk that found one

    def take(go) -> None:
        while go() and not bad:
            i = next(taken)
            if i >= len(chunks):
                return
            start, end = chunks[i]
            rc = _fn()(address, base + start * _PIECE.itemsize, end - start, out, bf16)
            if rc < 0:
                bad.append((i, start - rc - 1))

    helping = None

    def go() -> bool:
        nonlocal helping
        pace()
        if helping is None and helper is not None and helper.wide():
            helping = helper.submit(lambda: take(helper.wide))
        return True
    try:
        take(go)
    finally:
        if helping is not None and not helping.cancel():     # queued behind another job's chunks: not needed
            helping.result()
    return table.names[min(bad)[1]] if bad else None


class RowMajorFiles:
    """pack_file for the row-major layout (LoraPacker): the C packer's runs, tables kept per recipe."""

    def __init__(self) -> None:
        self._tables: dict = {}
        self._lock = threading.Lock()

    def pack_file(self, layout: PackedLayout, where, address: int, flat: torch.Tensor, pace,
                  pages: list[int] | None = None, helper=None) -> tuple | None:
        pe = flat.shape[1] if pages is not None else 0
        key = (id(layout), tuple(where.items()), pe)
        with self._lock:
            table = self._tables.pop(key, None)
            if table is None or table.layout is not layout:
                table = _row_major_table(layout, where, pe)
            self._tables[key] = table
            while len(self._tables) > PLANS_KEPT:
                del self._tables[next(iter(self._tables))]
        return run_table(table, address, flat, pace, pages, helper)


ROW_MAJOR = RowMajorFiles()


def can_pack_file(dtypes, dtype: torch.dtype) -> bool:
    """Whether the C packer reads tensors of these safetensors dtypes into `dtype` here."""
    return dtype in (torch.bfloat16, torch.float32) and set(dtypes) <= set(SRC_DTYPES) and _fn() is not None


_FN: object = False


def _fn():
    global _FN
    if _FN is False:
        fns = load_functions("lora_pack", {0: "pack_lora"})
        _FN = None if fns is None else fns[0]
    return _FN


class GroupPacker:
    zero_fill = True          # ranks below an adapter's rank and missing projections are zero rows

    def __init__(self, dtype: torch.dtype):
        self.paired = c_lora.pairs_b(dtype)
        self._plans: dict = {}      # (page_elems, shapes) -> PackedLayout, least recently planned first
        self._tables: dict = {}     # (layout, where) -> _PieceTable, least recently used first

    def b_elems(self, rank: int, out: int) -> int:
        return ((rank + 1) // 2) * 2 * out if self.paired else rank * out

    def plan(self, shapes: Shapes, page_elems: int) -> PackedLayout:
        """The adapter's blocks in its flat space. A layout depends on the shapes alone, and adapters trained
        with one recipe share them: the last PLANS_KEPT layouts are kept (they are immutable)."""
        key = (page_elems, tuple(sorted(shapes.items())))
        layout = self._plans.pop(key, None) or self._plan(shapes, page_elems)
        self._plans[key] = layout
        while len(self._plans) > PLANS_KEPT:
            del self._plans[next(iter(self._plans))]
        return layout

    def _plan(self, shapes: Shapes, page_elems: int) -> PackedLayout:
        """The blocks; then the experts' LoRA (kernels/lora_layout.py), row-major after them."""
        experts = {k: v for k, v in shapes.items() if is_expert(k[1])}
        layout = self._plan_blocks({k: v for k, v in shapes.items() if k not in experts}, page_elems)
        if not experts:
            return layout
        modules, off = dict(layout.modules), -(-layout.num_elems // ALIGN) * ALIGN
        for key in sorted(experts):
            r, n_in, n_out, scale = experts[key]
            modules[key] = ModuleSlice(off, off + r * n_in, r, n_in, n_out, scale)
            off += r * (n_in + n_out)
        return PackedLayout(modules, off, layout.blocks, layout.gaps)

    def _plan_blocks(self, shapes: Shapes, page_elems: int) -> PackedLayout:
        if not shapes:
            return PackedLayout({}, 0)
        R = max(r for r, *_ in shapes.values())
        groups: dict[tuple[int, str], dict[int, tuple[int, int, int]]] = {}   # (layer, group) -> {index: (r, in, out)}
        for (layer, module), (r, n_in, n_out, _) in shapes.items():
            g, i = GROUP_OF[module]
            groups.setdefault((layer, g), {})[i] = (r, n_in, n_out)
        pieces = []                                          # (elements, (layer, group), 'a' or output index)
        for key, outs in groups.items():
            n_in = next(iter(outs.values()))[1]
            pieces.append((R * len(GROUP_MODULES[key[1]]) * n_in, key, "a"))
            pieces += [(self.b_elems(R, n_out), key, i) for i, (_, _, n_out) in outs.items()]
        offsets, used = self._place(pieces, page_elems)
        blocks, gaps = {}, []
        for key, outs in groups.items():
            G = len(GROUP_MODULES[key[1]])
            b = tuple(offsets.get((key, i), -1) for i in range(G))
            blocks[key] = GroupBlock(offsets[(key, "a")], b, R)
            if len(outs) < G or any(r < R for r, _, _ in outs.values()):      # zero A rows the kernels read
                gaps.append((offsets[(key, "a")], R * G * next(iter(outs.values()))[1]))
            for i, (r, _, n_out) in outs.items():                                # zero ranks r..R of Bt
                if r < R or (self.paired and r % 2):
                    gaps.append((b[i], self.b_elems(R, n_out)))
        modules = {k: ModuleSlice(-1, -1, r, n_in, n_out, scale) for k, (r, n_in, n_out, scale) in shapes.items()}
        return PackedLayout(modules, used, blocks, tuple(sorted(gaps)))

    @staticmethod
    def _place(pieces, page_elems: int) -> tuple[dict, int]:
        """First fit, largest first: -> ({(key, part): flat offset}, elements spanned). Pages left with less
        room than the smallest piece are never looked at again."""
        free: list[int] = []                                 # next free element of each page
        open_pages: list[int] = []                           # pages that may still take a piece, in order
        smallest = min(p[0] for p in pieces)
        offsets = {}
        for n, key, part in sorted(pieces, key=lambda p: (-p[0], p[1], str(p[2]))):
            if n > page_elems:
                raise ValueError(f"adapter: its {key[1]} LoRA of layer {key[0]} is {n} elements, more than one page "
                                 f"of the pool holds ({page_elems}); raise the block size")
            page = next((i for i in open_pages if free[i] + n <= page_elems), None)
            if page is None:
                free.append(0)
                page = len(free) - 1
                open_pages.append(page)
            offsets[(key, part)] = page * page_elems + free[page]
            free[page] = min(page_elems, -(-(free[page] + n) // ALIGN) * ALIGN)
            if free[page] + smallest > page_elems:
                open_pages.remove(page)
        return offsets, (len(free) - 1) * page_elems + free[-1]

    def place(self, layout: PackedLayout, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor,
              flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """a [r, in], b [out, r] in any float dtype -> their rows of the module's group block (flat zeroed);
        an expert LoRA's A and B row-major where the layout says."""
        layer, module = key
        if is_expert(module):
            s = layout.modules[key]
            a, b = a.to(flat.dtype), b.to(flat.dtype)
            flat[s.a_offset:s.a_offset + a.numel()].copy_(a.flatten())
            flat[s.b_offset:s.b_offset + b.numel()].copy_(b.flatten())
            return [("lora_A", a), ("lora_B", b)]
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

    def can_pack_file(self, dtypes, dtype: torch.dtype) -> bool:
        """Whether pack_file reads tensors of these safetensors dtypes into `dtype` here (the C packer)."""
        return can_pack_file(dtypes, dtype)

    def pack_file(self, layout: PackedLayout, where, address: int, flat: torch.Tensor, pace,
                  pages: list[int] | None = None, helper=None) -> tuple | None:
        """Every module straight from the file's bytes at `address` into `flat` (zeroed): where[(layer, module)]
        = ((dtype, first byte, end byte) of A, of B), as AdapterFiles.where. The same bits as place().
        pages: write into these rows of `flat` [num_pages, page_elems] (the pool itself; its pages zeroed)
        instead of one contiguous space: a block never crosses a page, so each piece lands whole in one.
        Calls pace() between pieces of about CHUNK elements; runs two pieces at once on `helper`'s second
        thread while helper.wide() (engine/lora/loader.py: Helper). -> None, or ((layer, module), "lora_A" or
        "lora_B") of the first tensor holding NaN or infinity in the model dtype."""
        return run_table(self._pieces(layout, where), address, flat, pace, pages, helper)

    def _pieces(self, layout: PackedLayout, where) -> "_PieceTable":
        """pack_file's pieces of an adapter (flat offsets): adapters of one recipe share their layout and
        their header's offsets, so the last PLANS_KEPT tables are kept (building one is ~1 ms of Python)."""
        key = (id(layout), tuple(where.items()))
        table = self._tables.pop(key, None)
        if table is None or table.layout is not layout:
            table = _piece_table(layout, where, self.paired)
        self._tables[key] = table
        while len(self._tables) > PLANS_KEPT:
            del self._tables[next(iter(self._tables))]
        return table
