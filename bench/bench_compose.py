"""Several adapters on one request (engine/lora/compose.py) against one adapter each, in one run: default
model, bfloat16, `LLM()` at its defaults.

64 requests x (64 prompt + 64 new tokens) over 16 rank-8 adapters on all seven projections: (compose)
request i composes adapters i, i+1, i+2, i+3 (mod 16) with scales 1, 0.5, -0.5, 0.25 (16 compositions of
rank 32); (one) request i uses adapter i mod 16. Each side runs once to load its adapters, then the two
alternate, best of `--repeats` each; the ratio compose / one is printed (goal >= 0.7x).
Writes bench/results/compose.json and .png. Usage: python -m bench.bench_compose [--repeats 2]
"""
from __future__ import annotations

from bench.adapters import ALL, write_peft_adapter
from bench.bench_lora import alternate, pair_args, prompts_for
from bench.output import write_pair
from engine.config import EngineConfig
from engine.llm import LLM

NUM, ADAPTERS, RANK = 64, 16, 8
SCALES = (1.0, 0.5, -0.5, 0.25)


def main() -> None:
    args, work = pair_args(__doc__, "bench-compose-")
    cfg = EngineConfig.create(dtype="bfloat16").model
    names = [f"c{i}" for i in range(ADAPTERS)]
    llm = LLM(dtype="bfloat16")
    for i, name in enumerate(names):
        llm.register_adapter(name, str(write_peft_adapter(work / name, cfg, RANK, ALL, seed=i)))
    prompts = prompts_for(NUM, args.prompt_len)
    one = [names[i % ADAPTERS] for i in range(NUM)]
    composed = [[(names[(i + k) % ADAPTERS], s) for k, s in enumerate(SCALES)] for i in range(NUM)]
    ones, comps = alternate(llm, prompts, one, composed, args.out_len, args.repeats)
    print(f"{NUM} requests x {args.prompt_len}+{args.out_len} tokens over {ADAPTERS} rank-{RANK} adapters on all "
          f"projections, bfloat16, LLM() defaults; best of {args.repeats} alternated runs")
    write_pair("compose", ("one adapter each", ones), ("4 adapters composed", comps),
               f"{NUM} requests, rank-{RANK} adapters, bf16",
               {"requests": NUM, "adapters": ADAPTERS, "rank": RANK, "scales": SCALES}, goal="goal >= 0.7x")
    llm.close()


if __name__ == "__main__":
    main()
