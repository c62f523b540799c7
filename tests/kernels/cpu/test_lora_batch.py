"""The CPU multi-LoRA path, reading adapters in place in the pool's pages, against a per-token fp32 reference,
over token spreads and adapters of mixed ranks and targets; and the packer's layout those kernels read."""
import dataclasses
import random

import pytest
import torch

from kernels.cpu import gemm
from kernels.cpu import lora as c_lora
from kernels.cpu import lora_batch as cpu_lora
from kernels.cpu.lora_batch import LoraBatch
from kernels.cpu.lora_pack import GroupPacker
from kernels.cpu.paged_adapters import CpuPagedAdapters
from kernels.lora_layout import GROUP_MODULES
from tests.engine.lora.synthetic import SHAPES, TINY

PAGE = 4096
ALL = tuple(SHAPES)


@pytest.fixture(params=["c-kernel", "torch"], autouse=True)
def path(request, monkeypatch):
    """Every test runs on both paths: the C kernels and the torch fallback."""
    if request.param == "c-kernel":
        if not cpu_lora.c_lora.supports(torch.float32):
            pytest.skip("no C compiler here")
    else:
        monkeypatch.setattr(cpu_lora, "use_c_kernel", lambda adapters: False)
    return request.param


def random_modules(r: int, targets, seed: int, layers=(0, 1)) -> dict:
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in layers:
        for m in targets:
            n_in, n_out = SHAPES[m]
            mods[(layer, m)] = (torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g), 0.5 + seed % 3)
    return mods


def make_adapters(specs, dtype=torch.float32, num_pages=64, seed=0):
    """specs: [(rank, targets)] -> CpuPagedAdapters with adapter i + 1 in slot i, packed into scattered pages,
    and {adapter id: its modules}."""
    cfg = dataclasses.replace(TINY, dtype=dtype)
    storage = torch.full((num_pages, PAGE), float("nan"), dtype=dtype)    # what no block covers is never read
    adapters = CpuPagedAdapters(16, cfg, storage)
    packer = GroupPacker(dtype)
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    originals = {}
    for i, (r, targets) in enumerate(specs):
        mods = random_modules(r, targets, seed * 100 + i)
        layout = packer.plan({k: (r, a.shape[1], b.shape[0], s) for k, (a, b, s) in mods.items()}, PAGE)
        flat = torch.zeros(layout.num_pages(PAGE) * PAGE, dtype=dtype)
        for k, (a, b, _) in mods.items():
            packer.place(layout, k, a, b, flat)
        pages = [free.pop() for _ in range(layout.num_pages(PAGE))]
        storage[pages] = flat.view(-1, PAGE)
        assert adapters.assign(i + 1, layout, pages, set()) == i
        originals[i + 1] = mods
    return adapters, originals


def reference(originals, dtype, layer, group, x, token_slots, round_v=False):
    """fp32 per token: sum over the group's modules of (scale * B in the model dtype) @ (A x) (A x rounded to
    the model dtype with round_v, as the bf16 kernels keep it)."""
    outs = [SHAPES[m][1] for m in GROUP_MODULES[group]]
    y = torch.zeros(x.shape[0], sum(outs))
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        col = 0
        for m, out in zip(GROUP_MODULES[group], outs):
            if (layer, m) in originals[s + 1]:
                a, b, scale = originals[s + 1][(layer, m)]
                a, b = a.to(dtype).float(), (b.to(dtype) * scale).float()
                v = a @ x[t].float()
                y[t, col:col + out] = b @ (v.to(dtype).float() if round_v else v)
            col += out
    return y


MIXED = [(4, ALL), (16, ("q_proj", "v_proj")), (8, ("gate_proj", "up_proj", "down_proj")), (1, ALL),
         (12, ("k_proj", "o_proj")), (16, ALL)]


def spread(kind, rng, n_slots):
    if kind == "decode-distinct":
        return list(range(n_slots)) + [-1]
    if kind == "decode-shuffled":
        s = list(range(n_slots))
        rng.shuffle(s)
        return s
    if kind == "identical":
        return [1] * 12
    if kind == "zipf":
        return [min(int(rng.paretovariate(1.2)) - 1, n_slots - 1) for _ in range(30)] + [-1, -1]
    return [0] * 3 + [1] * 11 + [2] * 2 + [3] * 20 + [4] + [-1] * 3 + [5] * 9     # prefill segments and decodes


@pytest.mark.parametrize("kind", ["decode-distinct", "decode-shuffled", "identical", "zipf", "mixed-segments"])
def test_lora_batch_matches_per_token_reference(kind):
    rng = random.Random(1)
    adapters, originals = make_adapters(MIXED)
    token_slots = spread(kind, rng, len(MIXED))
    batch = LoraBatch.build(adapters, token_slots, len(token_slots) // 2)   # the first half are decode tokens
    for group, n_in in (("qkv", 32), ("o", 32), ("gate_up", 32), ("down", 64)):
        x = torch.randn(len(token_slots), n_in)
        ref = reference(originals, torch.float32, 1, group, x, token_slots)
        y = torch.zeros_like(ref)
        batch.apply(1, group, x, y)
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_reference(seed):
    rng = random.Random(seed)
    specs = [(rng.choice([1, 2, 4, 8, 16]), rng.choice([ALL, ("q_proj",), ("v_proj", "down_proj")]))
             for _ in range(rng.randint(1, 8))]
    adapters, originals = make_adapters(specs, seed=seed)
    token_slots = []
    for _ in range(rng.randint(1, 10)):        # requests: decodes, short and long prefill chunks, base
        token_slots += [rng.randrange(-1, len(specs))] * rng.choice([1, 1, 2, 5, 9, 17])
    if all(s < 0 for s in token_slots):
        token_slots[0] = 0
    batch = LoraBatch.build(adapters, token_slots, rng.randint(0, len(token_slots)))
    for layer, group, n_in in ((0, "qkv", 32), (1, "down", 64)):
        x = torch.randn(len(token_slots), n_in)
        ref = reference(originals, torch.float32, layer, group, x, token_slots)
        y = torch.zeros_like(ref)
        batch.apply(layer, group, x, y)
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


def test_sixty_four_distinct_adapters_in_one_step():
    """No slot count: 64 adapters of ranks 1..16 in one step, each token reading its own adapter's bytes."""
    specs = [(1 + i % 16, ALL if i % 3 else ("q_proj", "v_proj")) for i in range(64)]
    adapters, originals = make_adapters(specs, num_pages=400)
    token_slots = list(range(64)) + [s for s in range(0, 64, 7) for _ in range(5)]
    batch = LoraBatch.build(adapters, token_slots, 64)
    x = torch.randn(len(token_slots), 32)
    ref = reference(originals, torch.float32, 0, "qkv", x, token_slots)
    y = torch.zeros_like(ref)
    batch.apply(0, "qkv", x, y)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_bf16_batches_match_reference(seed, path):
    """bf16: decode tokens and (with AVX512-BF16 or AVX2) prefill segments through the C kernels."""
    rng = random.Random(seed)
    specs = [(rng.choice([1, 4, 8, 16]), rng.choice([ALL, ("q_proj", "k_proj")])) for _ in range(rng.randint(2, 6))]
    adapters, originals = make_adapters(specs, torch.bfloat16, seed=seed)
    token_slots = []
    for _ in range(rng.randint(2, 10)):
        token_slots += [rng.randrange(-1, len(specs))] * rng.choice([1, 1, 3, 5, 9, 17])
    token_slots[0] = 0
    batch = LoraBatch.build(adapters, token_slots, 1)
    if path == "c-kernel" and c_lora.supports_segments(torch.bfloat16) and any(s >= 0 for s in token_slots[1:]):
        assert batch.segments is not None
    x = (torch.randn(len(token_slots), 32) * 0.5).to(torch.bfloat16)
    ref = reference(originals, torch.bfloat16, 0, "qkv", x, token_slots)
    y = torch.zeros(ref.shape, dtype=torch.bfloat16)
    batch.apply(0, "qkv", x, y)
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=2e-2)


@pytest.fixture
def vdpbf16ps_tiles():
    """The C kernels' tiles on vdpbf16ps (as on a CPU without AMX) for the test, whatever this CPU has."""
    before = gemm.amx()
    gemm.amx(False)
    yield
    gemm.amx(before)


@pytest.mark.usefixtures("vdpbf16ps_tiles")
@pytest.mark.parametrize("group,n_in", [("qkv", 32), ("o", 32), ("gate_up", 32), ("down", 64)])
def test_bf16_decode_lora_inside_the_base_gemm(group, n_in, path):
    """With the C GEMM on vdpbf16ps, decode tokens' LoRA is computed by the GEMM itself (fused); prefill
    tokens' after it. Same result as the GEMM followed by the LoRA kernels."""
    from kernels.cpu.linear import CpuLinear as Linear
    adapters, originals = make_adapters([(4, ALL), (16, ALL), (8, ("q_proj", "down_proj", "up_proj"))],
                                        torch.bfloat16)
    if path != "c-kernel" or not cpu_lora.fuse_into_gemm(adapters):
        pytest.skip("needs the C GEMM (AVX512-BF16)")
    token_slots = [0, 2, -1, 1, 1, 1, 1, -1, 2, 2]         # 4 decode tokens, then prefill chunks
    batch = LoraBatch.build(adapters, token_slots, 4)
    width = sum(adapters.outs[group])
    g = torch.Generator().manual_seed(5)
    lin = Linear((torch.randn(width, n_in, generator=g) * 0.2).to(torch.bfloat16), kernel="c")
    x = (torch.randn(len(token_slots), n_in, generator=g) * 0.5).to(torch.bfloat16)
    assert batch.fused(1, group) is not None
    fused = batch.project(lin, 1, group, x)
    unfused = lin(x)
    batch.apply(1, group, x, unfused)
    ref = reference(originals, torch.bfloat16, 1, group, x, token_slots) + (x.float() @ lin.weight.float().T)
    torch.testing.assert_close(fused.float(), ref, atol=0.1, rtol=2e-2)
    torch.testing.assert_close(fused.float(), unfused.float(), atol=0.1, rtol=2e-2)
    assert torch.equal(fused[[2, 7]], lin(x)[[2, 7]])       # base tokens untouched


@pytest.mark.parametrize("group,n_in", [("qkv", 32), ("gate_up", 32), ("down", 64)])
def test_on_amx_decode_tokens_run_with_their_adapters_prefill_tokens(group, n_in, path):
    """Where the segment kernel runs on AMX tiles, decode tokens are grouped by adapter with the prefill
    tokens (no per-token kernel, nothing inside the GEMM): the reference's result, and every token's bits
    the same as when it runs alone (so they depend neither on the step nor on how a prompt was chunked)."""
    from kernels.cpu.linear import CpuLinear as Linear
    adapters, originals = make_adapters([(4, ALL), (16, ALL), (8, ("q_proj", "down_proj", "up_proj"))],
                                        torch.bfloat16)
    if path != "c-kernel" or not c_lora.segments_on_amx(torch.bfloat16):
        pytest.skip("needs AMX tiles")
    token_slots = [0, 2, -1, 1, 1, 1, 1, -1, 2, 2, 0] + [1] * 20   # 4 decode tokens, then prefill chunks
    batch = LoraBatch.build(adapters, token_slots, 4)
    assert batch.decode is None and batch.fused(1, group) is None
    assert sorted(batch.segments.tokens.tolist()) == [t for t, s in enumerate(token_slots) if s >= 0]
    width = sum(adapters.outs[group])
    g = torch.Generator().manual_seed(5)
    lin = Linear((torch.randn(width, n_in, generator=g) * 0.2).to(torch.bfloat16), kernel="c")
    x = (torch.randn(len(token_slots), n_in, generator=g) * 0.5).to(torch.bfloat16)
    y = batch.project(lin, 1, group, x)
    base = lin(x)
    ref = reference(originals, torch.bfloat16, 1, group, x, token_slots, round_v=True) + base.float()
    torch.testing.assert_close(y.float(), ref, atol=0, rtol=2 ** -7)    # y: the bf16 base + the delta, rounded
    for t, s in enumerate(token_slots):
        alone = LoraBatch.build(adapters, [s], 1)
        row = alone.project(lin, 1, group, x[t:t + 1]) if alone else lin(x[t:t + 1])
        assert torch.equal(row[0], y[t]), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packer_writes_the_layout_the_kernels_read(dtype):
    """An adapter of odd rank with rank_pattern-like mixed ranks: A rank-major in its group block, B pre-scaled
    and transposed (in bf16 with AVX512-BF16 paired by ranks, the odd rank's partner zero), no block across
    a page, and nothing at another adapter's rank."""
    adapters, originals = make_adapters([(5, ALL)], dtype)
    layout, pages = adapters.placed[0]
    for (layer, group), blk in layout.blocks.items():
        assert blk.rank == 5
        a, bs = adapters.block(0, layer, group)
        for i, m in enumerate(GROUP_MODULES[group]):
            A, B, scale = originals[1][(layer, m)]
            assert torch.equal(a[:, i], A.to(dtype))
            assert torch.equal(bs[i], (B.to(dtype) * scale).T)
    for (key, part_offset) in [(k, b.a_offset) for k, b in layout.blocks.items()]:
        n = 5 * len(GROUP_MODULES[key[1]]) * adapters.n_in[key[1]]
        assert part_offset // PAGE == (part_offset + n - 1) // PAGE, "a block crosses a page"
    assert layout.num_pages(PAGE) == len(pages)
    assert GroupPacker(dtype).paired == c_lora.pairs_b(dtype) == adapters.paired
