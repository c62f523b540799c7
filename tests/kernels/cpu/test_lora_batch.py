"""The CPU multi-LoRA path against a per-token fp32 reference, over token spreads and bucket layouts."""
import dataclasses
import random

import pytest
import torch

from kernels.cpu import lora as c_lora
from kernels.cpu import lora_batch as cpu_lora
from kernels.cpu.lora_batch import LoraBatch
from kernels.cpu.slots import CpuLoraSlots
from kernels.reference.slots import GROUPS
from tests.engine.lora.synthetic import TINY


@pytest.fixture(params=["c-kernel", "matmul"], autouse=True)
def path(request, monkeypatch):
    """Every test runs on both paths for one-token buckets: the C kernel and batched matmuls."""
    if request.param == "c-kernel":
        if not cpu_lora.c_lora.supports(torch.float32):
            pytest.skip("no C compiler here")
    else:
        monkeypatch.setattr(cpu_lora, "use_c_kernel", lambda slots: False)
    return request.param


NO_POOL = torch.zeros(1, 1)


def make_slots(ranks, dtype=torch.float32):
    slots = CpuLoraSlots(len(ranks), 16, dataclasses.replace(TINY, dtype=dtype), NO_POOL)   # buffers written directly
    g = torch.Generator().manual_seed(0)
    for s, r in enumerate(ranks):
        for name, buf in slots.buf.items():
            part = buf[:, s]
            part.zero_()
            if name.startswith("b") and slots.paired:   # B written through the paired layout's definition
                plain = torch.zeros(part.shape[0], 2 * part.shape[1], part.shape[2])
                plain[:, :r] = torch.randn(plain[:, :r].shape, generator=g)
                part.copy_(c_lora.pair_rows(plain.to(dtype)))
            else:
                part[:, :r].copy_(torch.randn(part[:, :r].shape, generator=g).to(dtype))   # A and B are rank-major
        slots.slot_of[s + 1] = s
        slots.rank_of[s + 1] = r
        slots.modules_of[s + 1] = frozenset(m for g_ in GROUPS.values() for m in g_[2])
    return slots


def reference(slots, layer, group, x, token_slots):
    a_name, b_names, _ = GROUPS[group]
    y = torch.zeros(x.shape[0], sum(slots.buf[b].shape[3] for b in b_names))
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        col = 0
        for i, b in enumerate(b_names):
            A = slots.buf[a_name][layer, s][:, i].float()  # [R, in]
            B = slots.b_rows(b, layer, s, slots.max_rank).float()   # [R, out]
            y[t, col:col + B.shape[1]] = B.T @ (A @ x[t].float())
            col += B.shape[1]
    return y


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
    # prefill segments of mixed lengths next to decodes: buckets whose slot ranges interleave
    return [0] * 3 + [1] * 11 + [2] * 2 + [3] * 20 + [4] + [-1] * 3 + [5] * 9


@pytest.mark.parametrize("kind", ["decode-distinct", "decode-shuffled", "identical", "zipf", "mixed-segments"])
def test_lora_batch_matches_per_token_reference(kind):
    rng = random.Random(1)
    ranks = [4, 16, 8, 1, 12, 16]
    slots = make_slots(ranks)
    token_slots = spread(kind, rng, len(ranks))
    # the first half of the tokens are taken as decode tokens (the C kernel's), the rest as prefill
    batch = LoraBatch.build(slots, token_slots, len(token_slots) // 2)
    for group, n_in in (("qkv", 32), ("o", 32), ("gate_up", 32), ("down", 64)):
        x = torch.randn(len(token_slots), n_in)
        ref = reference(slots, 1, group, x, token_slots)
        y = torch.zeros_like(ref)
        batch.apply(1, group, x, y)
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_match_reference(seed):
    rng = random.Random(seed)
    ranks = [rng.choice([1, 2, 4, 8, 16]) for _ in range(rng.randint(1, 6))]
    slots = make_slots(ranks)
    token_slots = []
    for _ in range(rng.randint(1, 10)):        # requests: decodes, short and long prefill chunks, base
        token_slots += [rng.randrange(-1, len(ranks))] * rng.choice([1, 1, 2, 5, 9, 17])
    if all(s < 0 for s in token_slots):
        token_slots[0] = 0
    batch = LoraBatch.build(slots, token_slots, rng.randint(0, len(token_slots)))
    x = torch.randn(len(token_slots), 32)
    ref = reference(slots, 0, "qkv", x, token_slots)
    y = torch.zeros_like(ref)
    batch.apply(0, "qkv", x, y)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_bf16_batches_match_reference(seed, path):
    """bf16: decode tokens and (with AVX512-BF16) prefill segments through the C kernels."""
    rng = random.Random(seed)
    ranks = [rng.choice([1, 4, 8, 16]) for _ in range(rng.randint(2, 6))]
    slots = make_slots(ranks, torch.bfloat16)
    token_slots = []
    for _ in range(rng.randint(2, 10)):
        token_slots += [rng.randrange(-1, len(ranks))] * rng.choice([1, 1, 3, 5, 9, 17])
    token_slots[0] = 0
    batch = LoraBatch.build(slots, token_slots, 1)
    if path == "c-kernel" and cpu_lora.c_lora.supports_segments(torch.bfloat16) and len(token_slots) > 1:
        assert batch.buckets == [] and (batch.segments is not None or all(s < 0 for s in token_slots[1:]))
    x = (torch.randn(len(token_slots), 32) * 0.5).to(torch.bfloat16)
    ref = reference(slots, 0, "qkv", x, token_slots)
    y = torch.zeros(ref.shape, dtype=torch.bfloat16)
    batch.apply(0, "qkv", x, y)
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("group,n_in", [("qkv", 32), ("o", 32), ("gate_up", 32), ("down", 64)])
def test_bf16_decode_lora_inside_the_base_gemm(group, n_in, path):
    """With the C GEMM, decode tokens' LoRA is computed by the GEMM itself (fused); prefill tokens' after
    it. Same result as the GEMM followed by the LoRA kernels."""
    from kernels.cpu.linear import CpuLinear as Linear
    if path != "c-kernel" or not cpu_lora.fuse_into_gemm(make_slots([4], torch.bfloat16)):
        pytest.skip("needs the C GEMM (AVX512-BF16)")
    slots = make_slots([4, 16, 8], torch.bfloat16)
    token_slots = [0, 2, -1, 1, 1, 1, 1, -1, 2, 2]         # 4 decode tokens, then prefill chunks
    batch = LoraBatch.build(slots, token_slots, 4)
    width = sum(slots.buf[b].shape[3] for b in GROUPS[group][1])
    g = torch.Generator().manual_seed(5)
    lin = Linear((torch.randn(width, n_in, generator=g) * 0.2).to(torch.bfloat16), kernel="c")
    x = (torch.randn(len(token_slots), n_in, generator=g) * 0.5).to(torch.bfloat16)
    assert batch.fused(1, group) is not None
    fused = batch.project(lin, 1, group, x)
    unfused = lin(x)
    batch.apply(1, group, x, unfused)
    ref = reference(slots, 1, group, x, token_slots) + (x.float() @ lin.weight.float().T)
    torch.testing.assert_close(fused.float(), ref, atol=0.1, rtol=2e-2)
    torch.testing.assert_close(fused.float(), unfused.float(), atol=0.1, rtol=2e-2)
    assert torch.equal(fused[[2, 7]], lin(x)[[2, 7]])       # base tokens untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_assign_writes_the_layout_the_kernels_read(tmp_path, dtype):
    """An adapter of odd rank copied from its packed pages into a slot: A rank-major, B pre-scaled and
    transposed, in bf16 with AVX512-BF16 paired by ranks (the odd rank's partner zero); b_rows reads it
    back whatever the layout."""
    from engine.lora.host_adapter import load_host_adapter
    from engine.lora.layout import pack, plan_layout
    from kernels.lora_layout import unpack_module
    from kernels.reference.slots import SLOT_OF_MODULE
    from tests.engine.lora.synthetic import SHAPES, write_adapter
    cfg = dataclasses.replace(TINY, dtype=dtype)
    host = load_host_adapter(write_adapter(tmp_path / "a", 5, tuple(SHAPES)), cfg, max_rank=8)
    layout = plan_layout(host)
    packed = pack(host, layout, 256)                        # [n, 256]
    flat = packed.flatten()
    pages = [3 + 2 * i for i in reversed(range(len(packed)))]   # scattered, out of order
    storage = torch.zeros(max(pages) + 1, 256, dtype=dtype)
    storage[pages] = packed
    slots = CpuLoraSlots(2, 8, cfg, storage)
    assert slots.paired == c_lora.pairs_b(dtype)
    s = slots.assign(1, layout, pages, busy=set())
    for (layer, module), ms in layout.modules.items():
        a, b = unpack_module(flat, ms)
        a_name, idx, b_name = SLOT_OF_MODULE[module]
        assert torch.equal(slots.buf[a_name][layer, s, :5, idx], a)
        want = torch.cat([(b * ms.scale).T, torch.zeros(3, b.shape[0], dtype=dtype)])
        assert torch.equal(slots.b_rows(b_name, layer, s, 8), want), (layer, module)
