"""The adapter loader: every byte of an adapter's way from its file to its pages, off the step thread.

One job per load, on a small bounded thread pool (`LoraConfig.loader_threads`, 1 by default): read the
weights (memory-mapped), convert them to the model dtype while packing them into their page-sized rows,
refuse NaN and infinite values, compute a DoRA adapter's row scales from the base weights (engine/lora/dora.py),
and on the host write the rows into the adapter's pages of the pool. On a
GPU the packed rows are pinned and the job ends there: the engine thread only enqueues their copy on the
side stream (engine/lora/page_copier.py), which costs microseconds. A load from the host tier is the
page write alone. The step thread sees a job only through its future: done (the pages are ready, or the
packed rows can be enqueued) or failed (a ValueError / OSError naming the problem). While the engine waits
for loads with nothing else to run, a job's C packing runs on two threads (`Helper`: one more thread,
used only then, since no forward pass can start meanwhile).

Why the pages may be written from another thread: they were allocated to the adapter before the job was
submitted and the adapter is LOADING until the engine thread has seen the job finish, so nothing reads them
(no request of it runs) and nothing else writes them (only RESIDENT adapters are evicted).

The loader must not slow the step, which on a small CPU keeps every core busy in barrier-synchronised
kernels: a thread that takes a core from one of them for a millisecond stalls the whole step as long. So
a job works in small pieces (one tensor, one page: about 0.1 ms each). While a forward pass computes
(`step_running`: the engine marks it) the job rests after each piece for DUTY_REST times as long as the
piece took, taking about 1 / (1 + DUTY_REST) of one core from the step; the rest of the time (the engine's
Python work between forward passes, when one core is idle, or an engine with nothing else to run) it runs
at full speed. Each loader thread runs torch with one intra-op thread (a job never starts a second OpenMP
team). Measured in docs/performance.md
(bench_load_stall).
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from engine.lora import dora
from engine.lora.host_adapter import AdapterFiles, check_finite, files_signature, mapped_weights
from engine.lora.int8_pages import Int8Pages
from engine.lora.peft_config import module_path
from kernels.lora_layout import LoraPacker, PackedLayout, is_expert

log = logging.getLogger("loraplex.lora")
DUTY_REST = 6.0     # while a step computes: rest 6x each piece's time (about 14% of one core)


def _init_thread() -> None:
    torch.set_num_threads(1)     # a job never starts an OpenMP team of its own beside the step's


def host_buffer(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """n uninitialised elements in host memory, page-locked when `pin` (a GPU copies them asynchronously)."""
    return torch.empty(n, dtype=dtype, pin_memory=pin)


def _no_pause() -> None:
    return None


def read_packed(files: AdapterFiles, layout: PackedLayout, page_elems: int, dtype: torch.dtype,
                packer: LoraPacker | None = None, pin: bool = False, pace=_no_pause,
                helper: "Helper | None" = None) -> torch.Tensor:
    """The adapter's weights straight into its page rows, in `packer`'s layout: -> [num_pages, page_elems] in
    `dtype`, zero where the layout leaves gaps; each tensor is read once (memory-mapped) and converted as it
    is copied into place. pace(): called before each module (the loader rests there while a step computes)."""
    packer = packer or LoraPacker()
    n = layout.num_pages(page_elems) * page_elems
    flat = host_buffer(n, dtype, pin)
    for start in range(0 if packer.zero_fill else layout.num_elems, n, page_elems):   # a page at a time
        pace()
        flat[start:start + page_elems].zero_()
    if packs_in_place(files, dtype, packer):
        _pack_from_file(files, layout, packer, flat, dtype, pace, helper=helper)
        return flat.view(-1, page_elems)
    modules = files.read() if hasattr(files, "read") else mapped_weights(files)    # a composition: its own
    for key, a, b in modules:
        pace()
        for name, stored in packer.place(layout, key, a, b, flat):
            check_finite(key, name, stored, dtype)
    return flat.view(-1, page_elems)


def packs_in_place(files: AdapterFiles, dtype: torch.dtype, packer: LoraPacker) -> bool:
    """Whether `packer` can write this adapter's file straight into its pages of the pool (one pass)."""
    dtypes = {d for pair in files.where.values() for d, _, _ in pair}
    experts = any(is_expert(module) for _, module in files.where)        # placed by `place`, row-major
    return hasattr(packer, "pack_file") and bool(files.where) and not experts and packer.can_pack_file(dtypes, dtype)


def pack_in_place(files: AdapterFiles, layout: PackedLayout, storage: torch.Tensor, pages: list[int],
                  dtype: torch.dtype, packer, pace=_no_pause, helper: "Helper | None" = None) -> None:
    """The adapter's weights from its file straight into its pages of the pool (host memory): the ranges the
    kernels read as zeros zeroed (`layout.gaps`; the pages held other data before), then every tensor read
    once (memory-mapped), converted and placed; no staging copy."""
    pe = storage.shape[1]
    flat = storage.view(-1)
    for start, n in layout.gaps:                # a gap lies inside one block, so inside one page
        pace()
        at = pages[start // pe] * pe + start % pe
        flat[at:at + n].zero_()
    _pack_from_file(files, layout, packer, storage, dtype, pace, pages, helper)


def _pack_from_file(files: AdapterFiles, layout: PackedLayout, packer, flat: torch.Tensor, dtype: torch.dtype,
                    pace, pages: list[int] | None = None, helper: "Helper | None" = None) -> None:
    """The backend's one-pass packer over the file, memory-mapped read-only (4-6% faster here than the
    copy-on-write mapping it had: fewer page-table updates); into `flat`'s rows `pages` when given (see
    GroupPacker.pack_file); with `helper`, on two threads while the engine has nothing else to run. The
    mapping is faulted in by the packing itself, piece by piece (the kernel maps 16 pages a fault): measured
    as fast as mapping it all first on one thread (MADV_POPULATE_READ, one call that no pace() can
    interrupt) and faster on two; one thread populating ahead while the other packs is twice as slow (their
    faults contend)."""
    if files_signature(files.path) != files.signature:
        raise ValueError(f"adapter: {files.weights} changed on disk since it was registered")
    with open(files.weights, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if len(mm) != files.nbytes:
            raise ValueError(f"adapter: {files.weights} changed on disk since it was registered")
        view = np.frombuffer(mm, dtype=np.uint8)
        try:
            bad = packer.pack_file(layout, files.where, view.ctypes.data, flat, pace, pages, helper)
        finally:
            del view
    finally:
        unmap(mm, helper)
    if bad is not None:
        (layer, module), name = bad
        raise ValueError(f"adapter: {module_path(layer, module)}.{name} holds NaN or infinite values (in {dtype})")


def unmap(mm: mmap.mmap, helper: "Helper | None") -> None:
    """Close a file's mapping; on `helper`'s thread when there is one, after the job (unmapping a 20 MB file
    takes ~0.3 ms of page-table teardown here, which a load waiting for its pages need not wait for)."""
    if helper is None:
        mm.close()
    else:
        helper.submit(mm.close)


class Helper:
    """A second thread for a load while the engine waits for loads with nothing else to run (`alone` set:
    AdapterManager.wait_loads): then no forward pass computes, so a job may take both cores for its pieces.
    The moment the engine may step again the flag is cleared and jobs go back to one thread."""

    def __init__(self) -> None:
        self.alone = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-loader-helper", initializer=_init_thread)

    def wide(self) -> bool:
        return self.alone.is_set()

    def submit(self, fn) -> Future:
        """Run fn() on the helper thread -> its future."""
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def write_pages(storage: torch.Tensor, pages: list[int], packed: torch.Tensor, pace=_no_pause) -> None:
    """packed [len(pages), page_elems] -> storage's rows `pages`, in order (host memory), a page at a time."""
    for page, row in zip(pages, packed):
        pace()
        storage[page].copy_(row)


class Loaded(NamedTuple):
    """A load's result: the packed rows for the pool (None: packed in place) and the host tier's copy of
    them (the same rows, or their Int8Pages; None: none made)."""
    packed: torch.Tensor | None
    host: torch.Tensor | Int8Pages | None


class CopyYielded(Exception):
    """A copy_out job stopped so that a load waiting behind it runs first (the copy is taken again later)."""


class AdapterLoader:
    def __init__(self, storage: torch.Tensor, dtype: torch.dtype, packer: LoraPacker, on_gpu: bool, threads: int = 1,
                 host_int8: bool = False, dora_scales=None):
        """packer: the backend's page layout; on_gpu: the pool is on a GPU (PageCopier.cuda): jobs pack
        pinned rows and leave the copy; host_int8: host copies are Int8Pages (quantized and dequantized
        here, on the loader's threads); dora_scales(files, pace): a DoRA adapter's vectors of g - 1
        (engine/lora/dora.py: scales, over the base model's weights), None where no base model is at hand."""
        self.host_int8 = host_int8
        self.dora_scales = dora_scales
        self._stream = torch.cuda.Stream() if on_gpu and torch.cuda.is_available() else None
        self.storage = storage                  # [num_pages, page_elems], the pool
        self.page_elems = storage.shape[1]
        self.dtype = dtype
        self.packer = packer
        self.cuda = on_gpu
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-loader",
                                       initializer=_init_thread)
        self.helper = Helper()                  # a second thread while the engine waits with nothing to run
        self.hold = threading.Event()           # tests: clear() to make every job wait (pause / resume)
        self.hold.set()
        self.gate = threading.Event()           # set while no step computes: jobs run at full speed then
        self.gate.set()
        self._last = time.perf_counter()
        self._lock = threading.Lock()
        self._loads_waiting = 0                 # load jobs submitted and not started: a copy_out gives way
        self._loads_pending = 0                 # load jobs submitted and not finished

    def load(self, files: AdapterFiles, layout: PackedLayout, pages: list[int],
             packed: torch.Tensor | Int8Pages | None = None) -> Future:
        """Start a load: -> a future of Loaded: the packed rows [len(pages), page_elems] and the host tier's
        copy of them. On the host the rows are in their pages when it completes; on a GPU the caller copies
        them (PageCopier). `packed`: the host tier's copy, if it has one (no file is read; an int8 one is
        dequantized here). On the host, when the backend's packer reads the file in one pass, the job packs
        straight into the pages and the future's result is Loaded(None, None): no host copy was made (the
        caller may take one later, `copy_out`)."""
        with self._lock:
            self._loads_waiting += 1
            self._loads_pending += 1
        return self.pool.submit(self._job, files, layout, pages, packed)

    def _job(self, files, layout, pages, packed):
        try:
            return self._load_job(files, layout, pages, packed)
        finally:
            with self._lock:
                self._loads_pending -= 1

    def _load_job(self, files, layout, pages, packed):
        with self._lock:
            self._loads_waiting -= 1
        self.hold.wait()
        if packed is None and not self.cuda and packs_in_place(files, self.dtype, self.packer):
            pack_in_place(files, layout, self.storage, pages, self.dtype, self.packer, pace=self._pace,
                          helper=self.helper)
            self._write_dora(files, layout, self.storage, pages)
            return Loaded(None, None)
        host = packed
        if isinstance(packed, Int8Pages):
            packed = packed.dequantize(self.dtype, pin=self.cuda)
        if packed is None:
            packed = read_packed(files, layout, self.page_elems, self.dtype, self.packer, pin=self.cuda,
                                 pace=self._pace, helper=self.helper)
            self._write_dora(files, layout, packed, range(packed.shape[0]))
            host = Int8Pages.quantize(packed) if self.host_int8 else packed
        if not self.cuda:
            write_pages(self.storage, pages, packed, pace=self._pace)
        return Loaded(packed, host)

    def _write_dora(self, files: AdapterFiles, layout: PackedLayout, rows: torch.Tensor, pages) -> None:
        """A DoRA adapter's vectors of g - 1 into its pages (`rows`' rows `pages`), computed here, once a load
        from its file (a host copy holds them already); on a GPU on the loader's own stream."""
        if not layout.dora:
            return
        if self.dora_scales is None:
            raise ValueError(f"adapter: {files.path} is a DoRA adapter; this engine has no base model weights "
                             f"to compute its magnitudes' scales from")
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            values = self.dora_scales(files, self._pace)
        dora.write(layout, values, rows, list(pages))

    def copy_out(self, pages: list[int], stop: threading.Event) -> Future:
        """Start copying these pages of the pool (host memory) into a new host buffer: -> a future of it,
        [len(pages), page_elems], or of CopyYielded when a load was submitted meanwhile (loads go first) or
        `stop` was set. NOTE: the pages may be freed and reused while it runs (the caller sets `stop` and
        discards the copy): it only reads them."""
        return self.pool.submit(self._copy_job, list(pages), stop)

    def _copy_job(self, pages: list[int], stop: threading.Event) -> torch.Tensor:
        self.hold.wait()
        out = host_buffer(len(pages) * self.page_elems, self.dtype, False).view(len(pages), self.page_elems)
        for row, page in zip(out, pages):
            while True:             # NOTE: only between forward passes (a copy is never urgent), never
                if self._loads_waiting or stop.is_set():            # keeping a load waiting meanwhile
                    raise CopyYielded("a load is waiting for the loader" if not stop.is_set() else "abandoned")
                if self.gate.wait(0.001):
                    break
            row.copy_(self.storage[page])
        return Int8Pages.quantize(out) if self.host_int8 else out

    def loads_pending(self) -> int:
        """Load jobs submitted and not finished (work that is never urgent gives way to them)."""
        return self._loads_pending

    def _pace(self) -> None:
        """Before each piece: while a step computes, rest DUTY_REST times as long as the last piece took."""
        now = time.perf_counter()
        if not self.gate.is_set():
            self.gate.wait(min(0.01, DUTY_REST * (now - self._last)))
        self._last = time.perf_counter()

    @contextlib.contextmanager
    def step_running(self):
        """Around a forward pass on the host: the jobs wait at their next piece until it ends. On a GPU the
        loader only packs host memory, which the step does not contend for: the gate stays open."""
        if self.cuda:
            yield
            return
        self.gate.clear()
        try:
            yield
        finally:
            self.gate.set()

    def pause(self) -> None:
        """Tests: jobs started from now on wait (a slow disk) until resume()."""
        self.hold.clear()

    def resume(self) -> None:
        self.hold.set()

    def close(self) -> None:
        self.hold.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.helper.close()
