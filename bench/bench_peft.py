"""S-LoRA's experiment on this machine: loraplex against Hugging Face transformers + PEFT, many adapters.

(1) `--experiment peft`: N requests (default 64), each on its own rank-16 adapter on all seven
    projections, P prompt + O new tokens (EOS ignored), bf16, same process: loraplex, then PEFT's
    mixed-adapter batch (`generate(..., adapter_names=[one per row])`, PEFT's own multi-adapter path).
    Prints both output tokens/s and the ratio (the target after the open issues: 10x).
(2) `--experiment sweep`: loraplex alone with 1, 8, 64, 256 and 1,000 adapters, each of R requests on
    one drawn uniformly (rank 8 / 16 adapters on q and v, as bench_lora (b)), the pool holding the KV of
    the batch and about `--resident` adapters: throughput should stay flat. Prints loads and evictions.
Usage: python -m bench.bench_peft [--experiment peft|sweep|all] [--num 64] [--prompt-len 64] [--out-len 64]
"""
from __future__ import annotations

import argparse
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
    cfg = EngineConfig.create(dtype=args.dtype).model
    dirs = [write_peft_adapter(work / f"a{i}", cfg, 16, ALL, seed=i) for i in range(args.num)]
    names = [f"a{i}" for i in range(args.num)]
    prompts = prompts_for(args.num, args.prompt_len)
    print(f"(1) {args.num} requests x {args.prompt_len}+{args.out_len} tokens, each its own rank-16 adapter on "
          f"all seven projections, {args.dtype}")
    llm = LLM(dtype=args.dtype, max_num_seqs=args.num, max_loras=args.num, max_lora_rank=16,
              max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30)
    for name, d in zip(names, dirs):
        llm.register_adapter(name, str(d))
    run_loraplex(llm, prompts[:4], names[:4], 4)                # warm-up
    ours = run_loraplex(llm, prompts, names, args.out_len)
    print(f"    loraplex           : {ours:8.1f} tok/s")
    llm.engine.adapters.close()
    del llm
    theirs = run_peft(args, dirs, names, prompts)
    print(f"    transformers + PEFT: {theirs:8.1f} tok/s   (generate with adapter_names, one adapter per row)")
    print(f"    ratio              : {ours / theirs:.1f}x PEFT (target 10x)")


def run_peft(args, dirs, names, prompts) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.model.resolve import resolve_model
    path, _ = resolve_model("default")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    t = time.perf_counter()
    model = PeftModel.from_pretrained(base, str(dirs[0]), adapter_name=names[0])
    for name, d in zip(names[1:], dirs[1:]):
        model.load_adapter(str(d), adapter_name=name)
    print(f"    (PEFT loaded {len(names)} adapters in {time.perf_counter() - t:.1f} s)")
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4,
                       adapter_names=names[:2], **kw)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.out_len,
                             min_new_tokens=args.out_len, adapter_names=names, **kw)
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


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
        llm.engine.adapters.close()
        del llm
    print(f"    slowest / fastest  : {min(results) / max(results):.2f} (flat: close to 1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", default="all", choices=["peft", "sweep", "all"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num", type=int, default=64, help="requests at a time (and adapters in (1))")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=256, help="(2): requests in each run")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8, 64, 256, 1000], help="(2): adapter counts")
    p.add_argument("--resident", type=int, default=64, help="(2): adapters the pool has room for")
    p.add_argument("--workdir", default=None, help="where to write adapters (kept for reuse)")
    args = p.parse_args()
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-adapters")
    if args.experiment in ("peft", "all"):
        experiment_peft(args, work)
    if args.experiment in ("sweep", "all"):
        experiment_sweep(args, work)


if __name__ == "__main__":
    main()
