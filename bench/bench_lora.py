"""Multi-LoRA throughput, both sides measured in one run.

(a) 64 decoding requests, each with its own rank-16 adapter on all seven projections, against the same
    requests with no adapter, same engine: prints both output tokens/s and the ratio (target >= 0.8).
(b) 1,000 registered adapters with Zipf(1.2) popularity and a pool that holds about 50 of them, against
    the same workload with a single adapter: prints throughput, loads, evictions, cold starts and the
    ratio (target >= 0.7). Each alternates its two sides on one engine (--repeats) and compares the best
    of each.
Usage: python bench/bench_lora.py [--experiment a|b|all] [--dtype bfloat16] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.adapters import ALL, mean_pages, write_peft_adapter
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import page_elems
from ipc.sampling_params import SamplingParams


def run(llm: LLM, prompts, adapters, out_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, adapter=adapters)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(prompts) * out_len
    return n / dt


def pair_args(doc: str, prefix: str):
    """The command line of a two-sided benchmark at LLM() defaults: --repeats, --prompt-len, --out-len,
    --workdir (a new temporary folder unless given) -> (args, workdir)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    return args, Path(args.workdir or tempfile.mkdtemp(prefix=prefix))


def alternate(llm: LLM, prompts, a, b, out_len: int, repeats: int) -> tuple[list[float], list[float]]:
    """Side a's and side b's adapters (lists as run takes them) once each to load them, then alternated
    `repeats` times -> tokens/s of every run of a, of b."""
    run(llm, prompts, a, 2)
    run(llm, prompts, b, 2)
    runs_a, runs_b = [], []
    for _ in range(repeats):
        runs_a.append(run(llm, prompts, a, out_len))
        runs_b.append(run(llm, prompts, b, out_len))
    return runs_a, runs_b


def stats_line(llm: LLM, before) -> str:
    s = llm.engine.adapters.stats
    return (f"loads {s.loads - before[0]}, evictions {s.evictions - before[1]}, "
            f"cold starts {s.cold_starts - before[2]}")


def snapshot(llm: LLM):
    s = llm.engine.adapters.stats
    return s.loads, s.evictions, s.cold_starts


def prompts_for(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (n, length), generator=g).tolist()


def experiment_a(args, work: Path) -> None:
    n, rank = 64, 16
    cfg = EngineConfig.create(dtype=args.dtype).model
    dirs = [write_peft_adapter(work / f"a{i}", cfg, rank, ALL, seed=i) for i in range(n)]
    llm = LLM(dtype=args.dtype, max_num_seqs=n, max_loras=n, max_lora_rank=rank, max_num_batched_tokens=2048,
              device=args.device, backend=args.backend,
              enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30)
    for i, d in enumerate(dirs):
        llm.register_adapter(f"a{i}", str(d))
    prompts = prompts_for(n, args.prompt_len)
    names = [f"a{i}" for i in range(n)]
    run(llm, prompts[:4], names[:4], 4)                     # warm-up (loads the first adapters)
    run(llm, prompts, names, 2)                             # every adapter resident: measure steady state
    before = snapshot(llm)
    loras, bases = [], []
    for _ in range(args.repeats):      # alternated, best of each: this machine's speed drifts within minutes
        loras.append(run(llm, prompts, names, args.out_len))
        bases.append(run(llm, prompts, [None] * n, args.out_len))
    lora, base = max(loras), max(bases)
    print(f"(a) {n} requests x {args.prompt_len}+{args.out_len} tokens, {args.dtype}, "
          f"best of {args.repeats} alternated runs")
    print(f"    base only          : {base:8.1f} tok/s   (runs: {', '.join(f'{b:.0f}' for b in bases)})")
    print(f"    64 rank-16 adapters: {lora:8.1f} tok/s   (runs: {', '.join(f'{x:.0f}' for x in loras)}; "
          f"{stats_line(llm, before)})")
    print(f"    ratio              : {lora / base:.2f}x base-only (target 0.8)")
    read_s, nbytes = read_time(llm.engine)
    steps = args.out_len - 1                    # decode steps: each reads every adapter's A and B once
    base_s = n * args.out_len / base
    print(f"    memory             : the adapters' {nbytes / 1e6:.0f} MB take {read_s * 1e3:.1f} ms to read once here "
          f"({nbytes / read_s / 1e9:.1f} GB/s); if those reads did not overlap compute, {steps} decode steps would "
          f"add {steps * read_s:.2f} s to the base run's {base_s:.2f} s: {base_s / (base_s + steps * read_s):.2f}x")
    llm.close()


def read_time(core) -> tuple[float, int]:
    """Best time to read once as many bytes as the resident adapters' pages hold (a plain sum over that much
    of the pool's storage: the kernels read the adapters where they rest), and that many bytes."""
    pages = sum(len(a.pages) for a in core.adapters.by_id.values())
    region = core.runner.storage[:pages]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        region.sum()
        if region.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, region.numel() * region.element_size()


def experiment_b(args, work: Path) -> None:
    n_adapters, n_requests, resident = 1000, args.requests, 50
    cfg = EngineConfig.create(dtype=args.dtype).model
    ranks = [8, 16]
    dirs = [write_peft_adapter(work / f"b{i}", cfg, ranks[i % 2], ("q_proj", "v_proj"), seed=10_000 + i)
            for i in range(n_adapters)]
    engine_cfg = EngineConfig.create(dtype=args.dtype)
    page_bytes = page_elems(engine_cfg) * torch.finfo(getattr(torch, args.dtype)).bits // 8
    kv_pages = args.concurrency * -(-(args.prompt_len + args.out_len) // engine_cfg.cache.block_size)
    adapter_pages = round(resident * mean_pages(dirs[:2], engine_cfg))   # rank 8 and 16
    g = torch.Generator().manual_seed(1)
    zipf = 1.0 / torch.arange(1, n_adapters + 1).float() ** 1.2
    picks = torch.multinomial(zipf / zipf.sum(), n_requests, replacement=True, generator=g).tolist()
    prompts = prompts_for(n_requests, args.prompt_len, seed=2)
    llm = LLM(dtype=args.dtype, max_num_seqs=args.concurrency, max_loras=args.concurrency, max_lora_rank=16,
              max_num_batched_tokens=2048, device=args.device, backend=args.backend, enable_prefix_caching=False,
              scheduling_policy=args.scheduling_policy,
              kv_cache_memory_bytes=(kv_pages + adapter_pages) * page_bytes)
    for i, d in enumerate(dirs):
        llm.register_adapter(f"b{i}", str(d))
    run(llm, prompts[:4], ["b0"] * 4, 4)
    workloads = {"zipf over 1000": [f"b{i}" for i in picks], "single adapter": ["b0"] * n_requests}
    results = {label: [] for label in workloads}
    for _ in range(args.repeats):      # alternated on one engine, best of each: the machine's speed drifts
        for label, names in workloads.items():
            before = snapshot(llm)
            results[label].append(run(llm, prompts, names, args.out_len))
            print(f"(b) {label:15s}: {results[label][-1]:8.1f} tok/s   ({stats_line(llm, before)}, "
                  f"pool {llm.engine.pool.num_pages} pages)")
    llm.close()
    zipf_best, single_best = max(results["zipf over 1000"]), max(results["single adapter"])
    print(f"    ratio              : {zipf_best / single_best:.2f}x single adapter, the best of each of "
          f"{args.repeats} alternated runs (target 0.7)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", default="all", choices=["a", "b", "all"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="alternated runs of each side")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workdir", default=None, help="where to write adapters (kept for reuse)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--backend", default="auto", help="the engine's compute backend")
    p.add_argument("--scheduling-policy", default="fair", choices=["fair", "fcfs"], help="(b): the engine's policy")
    args = p.parse_args()
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-adapters")
    if args.experiment in ("a", "all"):
        experiment_a(args, work)
    if args.experiment in ("b", "all"):
        experiment_b(args, work)


if __name__ == "__main__":
    main()
