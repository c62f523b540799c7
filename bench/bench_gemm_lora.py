"""What the multi-LoRA of a decode step costs in the CPU backend's projections, without the rest of the engine:
a decode step's GEMMs (the default model's 30 layers x 4 fused groups: qkv, o, gate_up, down; 64 rows), each
layer with its own weights and its own adapters (so they stream from memory as in the engine), four sides
alternated in one run:
- plain: the base GEMM alone;
- no rows: the LoRA call with no row holding an adapter (it runs the plain GEMM, as the engine's decoder
  does: what is left is the call's own cost);
- one adapter: every row on one rank-16 adapter (the LoRA's arithmetic; its bytes stay in cache);
- zipf: bench_peft's Zipf(1.2) picks over the 64 (26 distinct, the rows ordered by adapter as the engine
  orders them, so rows sharing one sit side by side);
- distinct: each row its own adapter, ranks 8 / 16 / 32 (arithmetic and the adapters' bytes, as
  bench_peft's uniform workload).
On AVX512-BF16 the GEMM adds the rows' LoRA itself (gemm_lora_avx512bf16.c); elsewhere the decode kernel
runs after it (lora.c), as the engine does. Prints each side's best step, its ratio to plain, and two
bounds: the LoRA's multiply-adds over the base's, and the time to read the distinct adapters' bytes once
(a plain sum over the same number of bytes). Writes bench/results/gemm_lora.json and .png.
Usage: python -m bench.bench_gemm_lora [--layers 30] [--rows 64] [--repeats 15]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from bench.bench_serving import zipf_picks
from bench.output import write
from kernels.cpu import gemm as c_gemm
from kernels.cpu import lora as c_lora

HIDDEN, INTER, Q, KV = 576, 1536, 576, 192        # the default model (SmolLM2-135M)
GROUPS = [(HIDDEN, [Q, KV, KV]), (Q, [HIDDEN]), (HIDDEN, [INTER, INTER]), (INTER, [HIDDEN])]
RANKS = (8, 16, 32)
SIDES = ("plain", "no rows", "one adapter", "zipf", "distinct")


class Group:
    """One fused group of one layer: its packed weight and `slots` adapters, each at its own rank, in the
    layout this CPU's kernels read."""

    def __init__(self, n_in: int, outs: list[int], slots: int, gen: torch.Generator):
        w = (torch.randn(sum(outs), n_in, generator=gen) * 0.05).to(torch.bfloat16)
        self.gemm = c_gemm.Gemm(w)
        self.n_in = n_in
        paired = c_lora.pairs_b(torch.bfloat16)
        ranks = [RANKS[s % len(RANKS)] for s in range(slots)]
        self.a = [(torch.randn(r, len(outs), n_in, generator=gen) * 0.05).to(torch.bfloat16) for r in ranks]
        self.b = [[(torch.randn(r, o, generator=gen) * 0.05).to(torch.bfloat16) for o in outs] for r in ranks]
        if paired:
            self.b = [[c_lora.pair_rows(b).contiguous() for b in bs] for bs in self.b]
        a_ptrs = torch.tensor([a.data_ptr() for a in self.a], dtype=torch.int64)
        b_ptrs = torch.tensor([b.data_ptr() for bs in self.b for b in bs], dtype=torch.int64)
        self.weights = c_lora.Weights(a_ptrs.data_ptr(), b_ptrs.data_ptr(), max(ranks), c_lora.GroupShape(n_in, outs),
                                      paired, torch.bfloat16, keep=(a_ptrs, b_ptrs))
        self.bytes = sum(t.numel() * 2 for t in self.a) + sum(b.numel() * 2 for bs in self.b for b in bs)


class Rows:
    """Which adapter (slot) and rank each of the step's rows has, as the kernels here take it."""

    def __init__(self, slots: list[int], ranks: list[int], m: int):
        tokens = torch.arange(len(slots))
        self.fused = c_lora.supports_fused(torch.bfloat16)
        self.rows = c_lora.LoraRows(tokens, torch.tensor(slots), torch.tensor(ranks), m) if self.fused else None
        self.decode = None if self.fused else c_lora.LoraDecode(tokens, torch.tensor(slots), torch.tensor(ranks),
                                                                torch.bfloat16)

    def __call__(self, g: Group, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return g.gemm(x, self.rows(g.weights))
        y = g.gemm(x)
        self.decode(x, y, g.weights)
        return y


def sides(rows: int) -> dict:
    one = [1] * rows                                              # slot 1: rank 16
    every = list(range(rows))
    zipf = sorted(zipf_picks(rows, rows, 1.2, random.Random(0)))  # as bench_peft draws them
    return {"plain": None, "no rows": Rows([], [], rows), "one adapter": Rows(one, [RANKS[1]] * rows, rows),
            "zipf": Rows(zipf, [RANKS[s % len(RANKS)] for s in zipf], rows),
            "distinct": Rows(every, [RANKS[s % len(RANKS)] for s in every], rows)}


def step(groups: list[Group], xs: dict, lora) -> None:
    for g in groups:
        if lora is None:
            g.gemm(xs[g.n_in])
        else:
            lora(g, xs[g.n_in])


def read_seconds(nbytes: int, repeats: int = 5) -> float:
    """The best time to read nbytes once (torch's sum over a float32 buffer of that size, every thread: the
    fastest plain read torch has here)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None, help="folder for the JSON and PNG (default bench/results)")
    args = p.parse_args(argv)
    if not c_gemm.supports(torch.bfloat16, HIDDEN) or not c_lora.supports(torch.bfloat16):
        raise SystemExit("bench_gemm_lora needs the C bf16 GEMM and LoRA kernels (AVX512-BF16 or AVX2 + FMA)")
    gen = torch.Generator().manual_seed(0)
    groups = [Group(n_in, outs, args.rows, gen) for _ in range(args.layers) for n_in, outs in GROUPS]
    xs = {n: torch.randn(args.rows, n, generator=gen).to(torch.bfloat16) for n in (HIDDEN, INTER)}
    loras = sides(args.rows)
    times = {name: [] for name in SIDES}
    for lora in loras.values():                                   # warm-up
        step(groups, xs, lora)
    for _ in range(args.repeats):                                 # alternated: drift hits every side alike
        for name, lora in loras.items():
            t = time.perf_counter()
            step(groups, xs, lora)
            times[name].append((time.perf_counter() - t) * 1e3)
    best = {name: min(ts) for name, ts in times.items()}
    base_macs = args.rows * args.layers * sum(n_in * sum(outs) for n_in, outs in GROUPS)
    per_rank = sum(n_in * len(outs) + sum(outs) for n_in, outs in GROUPS)     # A and B elements per rank
    lora_macs = args.rows * args.layers * RANKS[1] * per_rank
    adapter_bytes = sum(g.bytes for g in groups)
    read_ms = read_seconds(adapter_bytes) * 1e3
    path = "inside the GEMM (AVX512-BF16)" if c_lora.supports_fused(torch.bfloat16) else "after the GEMM (AVX2)"
    print(f"a decode step's GEMMs: {args.layers} layers x {len(GROUPS)} groups, {args.rows} rows; LoRA {path}")
    for name in SIDES:
        print(f"    {name:<12}: {best[name]:7.2f} ms  = {best[name] / best['plain']:.2f}x plain")
    print(f"    bounds: one rank-16 adapter's multiply-adds are {lora_macs / base_macs:.3f}x the base's; the "
          f"{args.rows} distinct adapters' {adapter_bytes / 1e6:.0f} MB read once: {read_ms:.2f} ms")

    def plot(ax):
        names = list(SIDES)
        ax.bar(names, [best[n] for n in names], color=["grey", "tab:blue", "tab:orange", "tab:purple", "tab:red"])
        ax.axhline(best["plain"] * (1 + lora_macs / base_macs), color="k", ls=":",
                   label="plain + one adapter's multiply-adds at the GEMM's rate")
        ax.axhline(best["plain"] + read_ms, color="tab:red", ls="--",
                   label="plain + reading the distinct adapters once")
        ax.set_ylabel("ms a decode step (best)")
        ax.set_title(f"decode step's GEMMs with multi-LoRA ({args.rows} rows, {args.layers} layers), LoRA {path}")
        ax.legend(fontsize=8)
    data = {"args": vars(args), "path": path, "best_ms": best, "runs_ms": times,
            "ratio_to_plain": {n: best[n] / best["plain"] for n in SIDES}, "lora_mac_ratio": lora_macs / base_macs,
            "adapter_bytes": adapter_bytes, "read_ms": read_ms}
    write("gemm_lora", data, plot, args.out)
    return data


if __name__ == "__main__":
    main()
