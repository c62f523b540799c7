"""Several adapters on one request (engine/lora/compose.py) against one adapter each, in one run: default
model, bfloat16, `LLM()` at its defaults.

64 requests x (64 prompt + 64 new tokens) over 16 rank-8 adapters on all seven projections: (compose)
request i composes adapters i, i+1, i+2, i+3 (mod 16) with scales 1, 0.5, -0.5, 0.25 (16 compositions of
rank 32); (one) request i uses adapter i mod 16. Each side runs once to load its adapters, then the two
alternate, best of `--repeats` each; the ratio compose / one is printed (goal >= 0.7x).
Writes bench/results/compose.json and .png. Usage: python -m bench.bench_compose [--repeats 2]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.adapters import ALL, write_peft_adapter
from bench.bench_lora import prompts_for, run
from bench.output import write
from engine.config import EngineConfig
from engine.llm import LLM

NUM, ADAPTERS, RANK = 64, 16, 8
SCALES = (1.0, 0.5, -0.5, 0.25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=64)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-compose-"))
    cfg = EngineConfig.create(dtype="bfloat16").model
    names = [f"c{i}" for i in range(ADAPTERS)]
    llm = LLM(dtype="bfloat16")
    for i, name in enumerate(names):
        llm.register_adapter(name, str(write_peft_adapter(work / name, cfg, RANK, ALL, seed=i)))
    prompts = prompts_for(NUM, args.prompt_len)
    one = [names[i % ADAPTERS] for i in range(NUM)]
    composed = [[(names[(i + k) % ADAPTERS], s) for k, s in enumerate(SCALES)] for i in range(NUM)]
    run(llm, prompts, one, 2)                     # loads every adapter and every composition
    run(llm, prompts, composed, 2)
    ones, comps = [], []
    for _ in range(args.repeats):
        ones.append(run(llm, prompts, one, args.out_len))
        comps.append(run(llm, prompts, composed, args.out_len))
    best_one, best_comp = max(ones), max(comps)
    ratio = best_comp / best_one
    print(f"{NUM} requests x {args.prompt_len}+{args.out_len} tokens over {ADAPTERS} rank-{RANK} adapters on all "
          f"projections, bfloat16, LLM() defaults; best of {args.repeats} alternated runs")
    print(f"    one adapter each      : {best_one:8.1f} tok/s   (runs: {', '.join(f'{x:.0f}' for x in ones)})")
    print(f"    4 adapters composed   : {best_comp:8.1f} tok/s   (runs: {', '.join(f'{x:.0f}' for x in comps)})")
    print(f"    ratio                 : {ratio:.2f}x one adapter each (goal >= 0.7x)")
    data = {"requests": NUM, "adapters": ADAPTERS, "rank": RANK, "scales": SCALES, "one_tok_s": ones,
            "composed_tok_s": comps, "ratio": ratio}

    def plot(ax):
        ax.bar(["one adapter each", "4 adapters composed"], [best_one, best_comp], color=["#4c72b0", "#dd8452"])
        ax.set_ylabel("tokens / s (best run)")
        ax.set_title(f"bench_compose: {ratio:.2f}x ({NUM} requests, rank-{RANK} adapters, bf16)")
    write("compose", data, plot)
    llm.engine.adapters.close()


if __name__ == "__main__":
    main()
