"""The C packer reads an adapter straight from its safetensors file into the CPU kernels' layout with the
bits of the torch path (GroupPacker.place), from float32, bfloat16 and float16 files, on one thread or two,
and names the first tensor holding NaN or infinity. Ranks: 5 (odd: B's scalar path), 2 to 64 (with AVX-512:
A streamed and B paired from any file dtype, its pairs transposed in registers where r / 2 is a power of two,
gathered for 6; on AVX2 without AVX512-BF16, float32 and bfloat16 files' B through the 8x8-transposing
path), 70 (B's ranks in two column tiles)."""
import ctypes
import mmap
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.lora.host_adapter import read_header
from engine.lora.loader import Helper
from kernels.cpu import lora_pack
from kernels.cpu.lora_pack import GroupPacker
from kernels.lora_layout import LoraPacker
from tests.engine.lora.synthetic import SHAPES

needs_c = pytest.mark.skipif(lora_pack._fn() is None, reason="no C compiler here")
PAGE = 32768


# float32 values at the edges of the rounding to bfloat16: halfway cases (to even, up and down), just past
# halfway, subnormals (rounded, not flushed), the largest values that stay finite, and values that overflow
# only once scaled (B is scaled after its conversion: a finite B times the scale may round to infinity)
EDGE_BITS = [0x3F808000, 0x3F818000, 0x3F808001, 0xBF808000, 0x00000001, 0x80008000, 0x0000C000, 0x007FFFFF,
             0x7F7F7FFF, 0xFF7F7FFF, 0x7F000000, 0x00800000]
EDGES = torch.from_numpy(np.array(EDGE_BITS, dtype=np.uint32).view(np.float32))


def write(path, src_dtype, rank=5, poison=None, edges=False, poison_bits=None, poison_value=None):
    g = torch.Generator().manual_seed(0)
    tensors, shapes = {}, {}
    for layer in range(2):
        for m, (n_in, n_out) in SHAPES.items():
            scale = 0.25 + 0.5 * layer if not edges else 4.0
            a, b = torch.randn(rank, n_in, generator=g) * 3, torch.randn(n_out, rank, generator=g) * 3
            if edges:
                a.view(-1)[:len(EDGES)], b.view(-1)[-len(EDGES):] = EDGES, EDGES
            tensors[f"{layer}.{m}.A"], tensors[f"{layer}.{m}.B"] = a.to(src_dtype), b.to(src_dtype)
            shapes[(layer, m)] = (rank, n_in, n_out, scale)
    for name in [poison] if isinstance(poison, str) else poison or ():
        tensors[name][1, 2] = float("inf")
    if poison_value:
        tensors[poison_value[0]][1, 3] = poison_value[1]
    for name, bits in (poison_bits or {}).items():      # float32 bit patterns: NaNs, values rounding to infinity
        tensors[name].view(torch.int32)[1, 1] = torch.tensor(bits, dtype=torch.int64).to(torch.int32)
    save_file(tensors, str(path))
    header = read_header(path)
    where = {k: tuple((header[f"{k[0]}.{k[1]}.{x}"]["dtype"], header[f"{k[0]}.{k[1]}.{x}"]["start"],
                       header[f"{k[0]}.{k[1]}.{x}"]["end"]) for x in "AB") for k in shapes}
    return tensors, shapes, where


def pack_file(packer, layout, where, path, flat, helper=None):
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        view = ctypes.c_char.from_buffer(mm)
        try:
            return packer.pack_file(layout, where, ctypes.addressof(view), flat, lambda: None, helper=helper)
        finally:
            del view


def pack_pages(packer, layout, where, path, n, page, dtype):
    """The adapter's n pages packed straight into a pool's scattered rows -> (pool, the rows, in order)."""
    pool = torch.zeros(2 * n + 3, page, dtype=dtype)
    pages = [2 * n + 2 - 2 * i for i in range(n)]              # scattered, descending
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        view = ctypes.c_char.from_buffer(mm)
        try:
            assert packer.pack_file(layout, where, ctypes.addressof(view), pool, lambda: None, pages) is None
        finally:
            del view
    return pool, pages


@pytest.fixture
def two_threads():
    """The loader's helper as it is while the engine waits for loads with nothing else to run."""
    helper = Helper()
    helper.alone.set()
    yield helper
    helper.close()


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rank", [2, 5, 6, 8, 16, 32, 64, 70])
@pytest.mark.parametrize("src_dtype, edges", [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.float16, False), (torch.float32, True)])
def test_the_c_packer_gives_the_torch_paths_bits(tmp_path, dtype, src_dtype, rank, edges, monkeypatch):
    """Every rank path of B (paired ranks transposed in registers for 2 to 64 ranks a power of two, gathered for
    6, scalar for odd ranks and above 64), with ordinary values and (float32 bit patterns) with the rounding's
    edge cases."""
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)            # many pieces of calls, as for a large adapter
    tensors, shapes, where = write(tmp_path / "w.safetensors", src_dtype, rank, edges=edges)
    packer = GroupPacker(dtype)
    layout = packer.plan(shapes, PAGE)
    want = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=dtype)
    for (layer, m) in shapes:
        packer.place(layout, (layer, m), tensors[f"{layer}.{m}.A"], tensors[f"{layer}.{m}.B"], want)
    got = torch.zeros_like(want)
    assert packer.can_pack_file({d for p in where.values() for d, _, _ in p}, dtype)
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", got) is None
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@needs_c
@pytest.mark.parametrize("rank", [5, 8])
@pytest.mark.parametrize("poison", ["1.up_proj.B", "0.o_proj.A"])
@pytest.mark.parametrize("wide", [False, True])
def test_the_c_packer_names_a_tensor_that_is_not_finite(tmp_path, rank, poison, wide, two_threads, monkeypatch):
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, rank, poison=poison)
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    layer, module, ab = poison.split(".")
    got = pack_file(packer, layout, where, tmp_path / "w.safetensors", flat, two_threads if wide else None)
    assert got == ((int(layer), module), f"lora_{ab}")


@needs_c
@pytest.mark.parametrize("rank", [8, 16, 6])
@pytest.mark.parametrize("bits", [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7F7F8000, 0xFF7FFFFF])
@pytest.mark.parametrize("name", ["1.gate_proj.B", "0.k_proj.A"])
def test_a_value_that_is_nan_or_infinite_in_bfloat16_is_named(tmp_path, rank, bits, name):
    """Quiet and signalling NaNs of any payload (the rounding must not carry one into a finite value) and
    finite float32 values that round to infinity, in B's paired paths and in A's."""
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, rank,
                             poison_bits={name: bits - (1 << 32) if bits >= 1 << 31 else bits})
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    layer, module, ab = name.split(".")
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", flat) == ((int(layer), module), f"lora_{ab}")


@needs_c
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["1.gate_proj.B", "0.k_proj.A"])
def test_a_half_precision_file_value_that_is_not_finite_is_named(tmp_path, src_dtype, value, name):
    _, shapes, where = write(tmp_path / "w.safetensors", src_dtype, 16, poison_value=(name, value))
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    layer, module, ab = name.split(".")
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", flat) == ((int(layer), module), f"lora_{ab}")


def threads_of_chunks(monkeypatch, each=None) -> list[str]:
    """Record the thread that packs each chunk (`each(thread name)` called after it)."""
    names, real = [], lora_pack._fn()

    def fn(*args):
        rc = real(*args)
        names.append(threading.current_thread().name)
        if each:
            each(names[-1])
        return rc
    monkeypatch.setattr(lora_pack, "_fn", lambda: fn)
    return names


@needs_c
@pytest.mark.parametrize("rank", [5, 8])
def test_two_threads_pack_the_bits_one_thread_packs(tmp_path, rank, two_threads, monkeypatch):
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)            # many pieces: both threads take several
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, rank)
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    one = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    two = torch.zeros_like(one)
    names = threads_of_chunks(monkeypatch, lambda name: name == "MainThread" and time.sleep(0.002))
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", one) is None
    assert set(names) == {"MainThread"}
    names.clear()
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", two, two_threads) is None
    assert any(n.startswith("loraplex-loader-helper") for n in names)       # it did run on two threads
    assert len(names) == len(set(lora_pack.GroupPacker(torch.bfloat16)._pieces(layout, where).chunks))  # each once
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


@needs_c
def test_the_helper_stops_taking_chunks_once_the_engine_may_step(tmp_path, two_threads, monkeypatch):
    """The engine stops waiting (alone cleared) after the helper's second chunk: it takes no third, the loader
    thread packs the rest, and the bits are those of one thread."""
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, 8)
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    one = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", one) is None

    def each(name):
        if name == "MainThread":
            time.sleep(0.002)                                  # the helper gets its chunks meanwhile
        elif names.count(name) == 2:
            two_threads.alone.clear()
    names = threads_of_chunks(monkeypatch, each)
    two = torch.zeros_like(one)
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", two, two_threads) is None
    assert len(names) > 6 and sum(not n.startswith("MainThread") for n in names) == 2
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


@needs_c
def test_two_threads_name_the_tensor_one_thread_names(tmp_path, two_threads, monkeypatch):
    """Two tensors hold infinity: the packer names the one a single thread meets first, on two threads too."""
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, 8, poison=["1.up_proj.B", "0.o_proj.A"])
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    first = pack_file(packer, layout, where, tmp_path / "w.safetensors", flat)
    assert first in {((1, "up_proj"), "lora_B"), ((0, "o_proj"), "lora_A")}
    for _ in range(5):
        assert pack_file(packer, layout, where, tmp_path / "w.safetensors", flat, two_threads) == first


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_into_scattered_pages_gives_each_page_what_the_flat_space_has(tmp_path, dtype):
    """The loader packs straight into the pool: page i of the adapter's flat space lands in pages[i]."""
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, rank=12)
    packer = GroupPacker(dtype)
    page = 4096
    layout = packer.plan(shapes, page)
    n = layout.num_pages(page)
    assert n >= 3
    flat = torch.zeros(n * page, dtype=dtype)
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", flat) is None
    pool, pages = pack_pages(packer, layout, where, tmp_path / "w.safetensors", n, page, dtype)
    for i, p in enumerate(pages):
        assert torch.equal(pool[p], flat[i * page:(i + 1) * page]), i
    others = sorted(set(range(pool.shape[0])) - set(pages))
    assert not pool[others].any()                              # nothing written outside its pages


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [5, 8])
def test_the_row_major_layout_packs_from_the_file_with_the_torch_paths_bits(tmp_path, dtype, src_dtype, rank,
                                                                           monkeypatch):
    """The Triton / reference backends' layout (LoraPacker: each tensor one run, runs at any alignment, split
    where the flat space crosses a page) from the C packer: what a GPU's staging rows and a CPU pool under
    that layout get."""
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)
    tensors, shapes, where = write(tmp_path / "w.safetensors", src_dtype, rank)
    packer = LoraPacker()
    page = 1000                                                # odd-sized pages: runs split inside tensors
    layout = packer.plan(shapes, page)
    n = layout.num_pages(page)
    want = torch.zeros(n * page, dtype=dtype)
    for (layer, m) in shapes:
        packer.place(layout, (layer, m), tensors[f"{layer}.{m}.A"], tensors[f"{layer}.{m}.B"], want)
    assert packer.can_pack_file({d for p in where.values() for d, _, _ in p}, dtype)
    flat = torch.zeros_like(want)
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", flat) is None
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(flat.view(bits), want.view(bits))
    pool, pages = pack_pages(packer, layout, where, tmp_path / "w.safetensors", n, page, dtype)
    for i, p in enumerate(pages):
        assert torch.equal(pool[p].view(bits), want[i * page:(i + 1) * page].view(bits)), i


@needs_c
@pytest.mark.parametrize("wide", [False, True])
def test_the_row_major_packer_names_a_tensor_that_is_not_finite(tmp_path, wide, two_threads, monkeypatch):
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, 8, poison="1.down_proj.A")
    packer = LoraPacker()
    layout = packer.plan(shapes, PAGE)
    flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    got = pack_file(packer, layout, where, tmp_path / "w.safetensors", flat, two_threads if wide else None)
    assert got == ((1, "down_proj"), "lora_A")
