"""S-LoRA's experiment on this machine: loraplex against Hugging Face transformers + PEFT, many adapters.

(1) `--experiment peft`: N requests (default 64) over N adapters of ranks 8 / 16 / 32 on all seven
    projections, P prompt + O new tokens (EOS ignored), bf16, loraplex at its defaults (`LLM()`, no flags),
    in one process: the adapters picked uniformly (request i on adapter i) and by Zipf(1.2), and loraplex on
    the base model alone, the three alternated `--repeats` times (medians; each run new prompts, so none is
    found in the prefix cache); PEFT's mixed-adapter batch (`generate(..., adapter_names=[one per row])`,
    its own multi-adapter path) for both picks. Prints output tokens/s and the ratios (goals: >= 10x PEFT,
    >= 0.85x loraplex's base model); writes bench/results/peft.json and .png.
(2) `--experiment sweep`: loraplex alone with 1, 8, 64, 256 and 1,000 adapters, each of R requests on
    one drawn uniformly (rank 8 / 16 adapters on q and v, as bench_lora (b)), the pool holding the KV of
    the batch and about `--resident` adapters: throughput should stay flat. Prints loads and evictions.
Usage: python -m bench.bench_peft [--experiment peft|sweep|all] [--num 64] [--prompt-len 64] [--out-len 64]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.adapters import ALL, mean_pages, write_peft_adapter
from bench.bench_lora import prompts_for, snapshot, stats_line
from bench.bench_lora import run as run_loraplex
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import page_elems


def experiment_peft(args, work: Path) -> None:
    import random

    from bench.bench_serving import zipf_picks
    from bench.output import write
    cfg = EngineConfig.create(dtype=args.dtype).model
    ranks = (8, 16, 32)
    dirs = [write_peft_adapter(work / f"m{i}", cfg, ranks[i % 3], ALL, seed=i) for i in range(args.num)]
    names = [f"m{i}" for i in range(args.num)]
    picks = {"uniform": names, "zipf": [names[i] for i in zipf_picks(args.num, args.num, 1.2, random.Random(0))]}
    prompts = prompts_for(args.num, args.prompt_len)
    print(f"(1) {args.num} requests x {args.prompt_len}+{args.out_len} tokens over {args.num} adapters of ranks "
          f"8/16/32 on all seven projections, {args.dtype}; loraplex at its defaults (LLM(dtype={args.dtype!r}))")
    llm = LLM(dtype=args.dtype, device=args.device)
    for name, d in zip(names, dirs):
        llm.register_adapter(name, str(d))
    run_loraplex(llm, prompts, names, 2)                        # warm-up: every adapter loaded once
    # the sides alternated `repeats` times, each run its own prompts (none is found in the prefix cache)
    sides, runs = {**picks, "base": [None] * args.num}, {}
    for rep in range(args.repeats):
        for i, (k, v) in enumerate(sides.items()):
            prompts_k = prompts_for(args.num, args.prompt_len, seed=1 + rep * len(sides) + i)
            runs.setdefault(k, []).append(run_loraplex(llm, prompts_k, v, args.out_len))
    ours = {k: statistics.median(runs[k]) for k in picks}
    base = statistics.median(runs["base"])
    print("    runs (tok/s): " + "; ".join(f"{k} " + ", ".join(f"{v:.1f}" for v in r) for k, r in runs.items()))
    print(f"    loraplex, base model : {base:8.1f} tok/s (median of {args.repeats})")
    for k, v in ours.items():
        met = "met" if v / base >= 0.85 else "not met"
        print(f"    loraplex, {k:10s} : {v:8.1f} tok/s   ({v / base:.3f}x its base model; goal >= 0.85x: {met})")
    llm.close()
    del llm
    theirs = run_peft(args, dirs, names, prompts, picks)
    res = {"base_tok_s": base, "loraplex_tok_s": ours, "peft_tok_s": theirs, "loraplex_runs": runs,
           "x_peft": {k: ours[k] / theirs[k] for k in picks}, "x_base": {k: ours[k] / base for k in picks}}
    for k in picks:
        print(f"    transformers + PEFT, {k:7s}: {theirs[k]:8.1f} tok/s   -> loraplex {res['x_peft'][k]:.1f}x PEFT "
              f"(goal >= 10x: {'met' if res['x_peft'][k] >= 10 else 'not met'})")

    def plot(ax):
        labels = ["base model", *[f"adapters, {k}" for k in picks]]
        ax.bar([x - 0.2 for x in range(3)], [base, *ours.values()], width=0.4, label="loraplex (defaults)")
        ax.bar([x + 0.2 for x in (1, 2)], list(theirs.values()), width=0.4, label="transformers + PEFT")
        ax.set_xticks(range(3), labels)
        ax.set_ylabel("output tokens / s")
        ax.legend()
        ax.set_title(f"bench_peft: {args.num} requests over {args.num} adapters (ranks 8/16/32, all projections), "
                     f"{args.dtype}")
    write("peft", {"args": vars(args), **res}, plot, args.out)


def run_peft(args, dirs, names, prompts, picks: dict) -> dict[str, float]:
    """PEFT's tokens/s for each pick of adapters (one generate call over every row)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.model.resolve import resolve_model
    path, _ = resolve_model("default")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval().to(args.device)
    t = time.perf_counter()
    model = PeftModel.from_pretrained(base, str(dirs[0]), adapter_name=names[0])
    for name, d in zip(names[1:], dirs[1:]):
        model.load_adapter(str(d), adapter_name=name)
    print(f"    (PEFT loaded {len(names)} adapters in {time.perf_counter() - t:.1f} s)")
    ids = torch.tensor(prompts, device=args.device)
    kw = dict(do_sample=False, pad_token_id=0)
    out = {}
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4,
                       adapter_names=names[:2], **kw)
        for k, rows in picks.items():
            t = time.perf_counter()
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.out_len,
                                 min_new_tokens=args.out_len, adapter_names=rows, **kw)
            out[k] = (gen.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t)
    return out


def experiment_sweep(args, work: Path) -> None:
    cfg = EngineConfig.create(dtype=args.dtype)
    ranks = [8, 16]
    page_bytes = page_elems(cfg) * torch.finfo(getattr(torch, args.dtype)).bits // 8
    kv_pages = args.num * -(-(args.prompt_len + args.out_len) // cfg.cache.block_size)
    prompts = prompts_for(args.requests, args.prompt_len, seed=2)
    print(f"(2) {args.requests} requests x {args.prompt_len}+{args.out_len} tokens, {args.num} at a time, adapters "
          f"(rank 8/16, q and v) drawn uniformly; the pool holds the batch's KV and ~{args.resident} adapters")
    results = []
    per_adapter = mean_pages([write_peft_adapter(work / f"b{i}", cfg.model, ranks[i % 2], ("q_proj", "v_proj"),
                                                 seed=10_000 + i) for i in range(2)], cfg)
    for n in args.counts:
        dirs = [write_peft_adapter(work / f"b{i}", cfg.model, ranks[i % 2], ("q_proj", "v_proj"), seed=10_000 + i)
                for i in range(n)]
        llm = LLM(dtype=args.dtype, max_num_seqs=args.num, max_loras=args.num, max_lora_rank=16,
                  max_num_batched_tokens=2048, enable_prefix_caching=False,
                  kv_cache_memory_bytes=(kv_pages + round(args.resident * per_adapter)) * page_bytes)
        for i, d in enumerate(dirs):
            llm.register_adapter(f"b{i}", str(d))
        pick = torch.randint(0, n, (args.requests,), generator=torch.Generator().manual_seed(3)).tolist()
        names = [f"b{i}" for i in pick]                       # uniform over the n adapters
        run_loraplex(llm, prompts[:4], names[:4], 4)
        before = snapshot(llm)
        tps = run_loraplex(llm, prompts, names, args.out_len)
        results.append(tps)
        print(f"    {n:5d} adapters: {tps:8.1f} tok/s   ({stats_line(llm, before)})")
        llm.close()
        del llm
    print(f"    slowest / fastest  : {min(results) / max(results):.2f} (flat: close to 1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)     # `--out` is not `--out-len`
    p.add_argument("--experiment", default="all", choices=["peft", "sweep", "all"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda: both sides run there (make gpu-check: cuda)")
    p.add_argument("--num", type=int, default=64, help="requests at a time (and adapters in (1))")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="(1): loraplex's runs of each side, alternated (median)")
    p.add_argument("--requests", type=int, default=256, help="(2): requests in each run")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8, 64, 256, 1000], help="(2): adapter counts")
    p.add_argument("--resident", type=int, default=64, help="(2): adapters the pool has room for")
    p.add_argument("--workdir", default=None, help="where to write adapters (kept for reuse)")
    p.add_argument("--out", default=None, help="folder for (1)'s JSON and PNG (default bench/results)")
    args = p.parse_args()
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-adapters")
    if args.experiment in ("peft", "all"):
        experiment_peft(args, work)
    if args.experiment in ("sweep", "all"):
        experiment_sweep(args, work)


if __name__ == "__main__":
    main()
