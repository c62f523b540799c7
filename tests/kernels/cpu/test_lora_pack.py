"""The C packer reads an adapter straight from its safetensors file into the CPU kernels' layout with the
bits of the torch path (GroupPacker.place), from float32, bfloat16 and float16 files, and names the first
tensor holding NaN or infinity."""
import ctypes
import mmap

import pytest
import torch
from safetensors.torch import save_file

from engine.lora.host_adapter import read_header
from kernels.cpu import lora_pack
from kernels.cpu.lora_pack import GroupPacker
from tests.engine.lora.synthetic import SHAPES

needs_c = pytest.mark.skipif(lora_pack._fn() is None, reason="no C compiler here")
PAGE = 32768


def write(path, src_dtype, rank=5, poison=None):
    g = torch.Generator().manual_seed(0)
    tensors, shapes = {}, {}
    for layer in range(2):
        for m, (n_in, n_out) in SHAPES.items():
            scale = 0.25 + 0.5 * layer
            a, b = torch.randn(rank, n_in, generator=g) * 3, torch.randn(n_out, rank, generator=g) * 3
            tensors[f"{layer}.{m}.A"], tensors[f"{layer}.{m}.B"] = a.to(src_dtype), b.to(src_dtype)
            shapes[(layer, m)] = (rank, n_in, n_out, scale)
    if poison:
        tensors[poison][1, 2] = float("inf")
    save_file(tensors, str(path))
    header = read_header(path)
    where = {k: tuple((header[f"{k[0]}.{k[1]}.{x}"]["dtype"], header[f"{k[0]}.{k[1]}.{x}"]["start"],
                       header[f"{k[0]}.{k[1]}.{x}"]["end"]) for x in "AB") for k in shapes}
    return tensors, shapes, where


def pack_file(packer, layout, where, path, flat):
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        view = ctypes.c_char.from_buffer(mm)
        try:
            return packer.pack_file(layout, where, ctypes.addressof(view), flat, lambda: None)
        finally:
            del view


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [5, 70])          # 70: B's ranks in two column tiles of the C packer
def test_the_c_packer_gives_the_torch_paths_bits(tmp_path, dtype, src_dtype, rank, monkeypatch):
    monkeypatch.setattr(lora_pack, "CHUNK", 1000)            # many pieces of calls, as for a large adapter
    tensors, shapes, where = write(tmp_path / "w.safetensors", src_dtype, rank)
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
def test_the_c_packer_names_a_tensor_that_is_not_finite(tmp_path):
    _, shapes, where = write(tmp_path / "w.safetensors", torch.float32, poison="1.up_proj.B")
    packer = GroupPacker(torch.bfloat16)
    layout = packer.plan(shapes, PAGE)
    flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=torch.bfloat16)
    assert pack_file(packer, layout, where, tmp_path / "w.safetensors", flat) == ((1, "up_proj"), "lora_B")


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
    pool = torch.zeros(2 * n + 3, page, dtype=dtype)
    pages = [2 * n + 2 - 2 * i for i in range(n)]              # scattered, descending
    with open(tmp_path / "w.safetensors", "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        view = ctypes.c_char.from_buffer(mm)
        try:
            assert packer.pack_file(layout, where, ctypes.addressof(view), pool, lambda: None, pages) is None
        finally:
            del view
    for i, p in enumerate(pages):
        assert torch.equal(pool[p], flat[i * page:(i + 1) * page]), i
    others = sorted(set(range(pool.shape[0])) - set(pages))
    assert not pool[others].any()                              # nothing written outside its pages
