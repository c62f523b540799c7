"""`--host-tier-dtype int8` against the default host tier (the model's dtype), in one run: default model,
bfloat16, the engine's defaults otherwise.

(1) Capacity: 64 adapters of ranks 8/16/32 on all projections each run once, so each leaves a host copy,
    with the same `max_cpu_lora_bytes` (16x their weights' mean bf16 size, `--max-cpu-loras 1000`): how many
    copies each tier keeps, and the ratio (int8 / default).
(2) Fidelity: the eight fidelity adapters (tests/peft_adapters.py: ranks 4 to 64, rsLoRA, rank and alpha
    patterns, layer subsets), each run once, evicted from the pool, and run again from its host copy:
    greedy tokens (8 text prompts x 32 new tokens per adapter) from the int8 copy against those from the
    default copy: the share of sequences identical and of tokens before each sequence's first difference;
    as a yardstick of how far greedy text moves under rounding at all, the same for the engine in float32
    against bf16.
Writes bench/results/host_tier.json and .png. Usage: python -m bench.bench_host_tier [--num 64]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.adapters import ALL, write_peft_adapter
from bench.output import write
from engine.config import EngineConfig
from engine.llm import LLM
from ipc.sampling_params import SamplingParams


def capacity(args, work: Path) -> dict:
    cfg = EngineConfig.create(dtype="bfloat16").model
    ranks = (8, 16, 32)
    dirs = [write_peft_adapter(work / f"c{i}", cfg, ranks[i % 3], ALL, seed=i) for i in range(args.num)]
    per_adapter = sum(f.stat().st_size for d in dirs for f in d.glob("*.safetensors")) / len(dirs) / 2  # f32 files
    budget = int(16 * per_adapter)
    out = {}
    for dtype in ("auto", "int8"):
        llm = LLM(dtype="bfloat16", max_cpu_loras=1000, max_cpu_lora_bytes=budget, host_tier_dtype=dtype)
        for i, d in enumerate(dirs):
            llm.register_adapter(f"c{i}", str(d))
        params = SamplingParams(temperature=0, max_tokens=1)
        for i in range(args.num):
            llm.generate([[100 + i, 200, 300]], params, adapter=f"c{i}")
        m = llm.engine.adapters
        m.settle()
        out[dtype] = {"kept": len(m.host), "bytes": m.host.nbytes}
        print(f"  host tier {dtype:4s}: keeps {len(m.host):3d} of {args.num} adapters in {m.host.nbytes / 2**20:7.1f} "
              f"MiB (budget {budget / 2**20:.1f} MiB)")
        m.close()
        del llm
    out["ratio"] = out["int8"]["kept"] / out["auto"]["kept"]
    out["budget"] = budget
    print(f"  capacity: {out['ratio']:.2f}x the adapters with int8 host copies")
    return out


PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at a temperature of", "My favourite book is",
           "In 1969, the first humans", "To make a cup of tea, first"]


def fidelity(args, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from engine.model.resolve import resolve_model
    from tests.peft_adapters import FIDELITY_ADAPTERS, make_adapters
    path, _ = resolve_model("default")
    make_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), work, FIDELITY_ADAPTERS)
    prompts = PROMPTS
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for dtype in ("auto", "int8", "float32"):       # float32: the same engine in float32, as a yardstick
        llm = LLM(dtype="float32" if dtype == "float32" else "bfloat16",
                  host_tier_dtype="int8" if dtype == "int8" else "auto")
        for name in FIDELITY_ADAPTERS:
            llm.register_adapter(name, str(work / name))
        m = llm.engine.adapters
        for name in FIDELITY_ADAPTERS:
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), adapter=name)
        m.settle()
        m.evict_idle(llm.engine.pool.num_pages)           # every adapter off the pool: the next runs load
        hits = m.stats.host_hits                          # from their host copies
        tokens[dtype] = {n: [o.token_ids for o in llm.generate(prompts, params, adapter=n)] for n in FIDELITY_ADAPTERS}
        assert m.stats.host_hits - hits >= len(FIDELITY_ADAPTERS), "the second runs did not load from the host tier"
        m.close()
        del llm
    res = {}
    for other, what in (("int8", "int8 host copies"), ("float32", "yardstick: the engine in float32")):
        same = prefix = total = 0
        per = {}
        for name in FIDELITY_ADAPTERS:
            a, b = tokens["auto"][name], tokens[other][name]
            eq = sum(x == y for x, y in zip(a, b))
            pre = sum(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b))
            per[name] = {"identical": eq / len(a), "tokens_before_first_difference": pre / sum(map(len, a))}
            same, prefix, total = same + eq, prefix + pre, total + sum(map(len, a))
            if other == "int8":
                print(f"  {name:11s}: {eq}/{len(a)} sequences identical, "
                      f"{per[name]['tokens_before_first_difference']:.3f} of tokens before the first difference")
        res[other] = {"sequences_identical": same / (len(prompts) * len(FIDELITY_ADAPTERS)),
                      "tokens_before_first_difference": prefix / total, "per_adapter": per}
        print(f"  {what} vs bf16 from full-precision copies: {res[other]['sequences_identical']:.3f} of sequences "
              f"identical, {res[other]['tokens_before_first_difference']:.3f} of tokens before the first difference")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"(1) capacity: {args.num} adapters, ranks 8/16/32, all projections, bf16")
        cap = capacity(args, Path(tmp))
        print("(2) fidelity: the eight fidelity adapters reloaded from their host copies, bf16 greedy")
        fid = fidelity(args, Path(tmp) / "fidelity")

    def plot(ax):
        ax.bar(["default host tier", "int8 host tier"], [cap["auto"]["kept"], cap["int8"]["kept"]],
               color=["gray", "tab:blue"])
        ax.set_ylabel(f"adapters kept in {cap['budget'] / 2**20:.0f} MiB")
        ax.set_title(f"bench_host_tier: {cap['ratio']:.2f}x the adapters; greedy tokens from int8 copies: "
                     f"{fid['int8']['sequences_identical']:.0%} of sequences identical "
                     f"(float32 vs bf16: {fid['float32']['sequences_identical']:.0%})", fontsize=9)
    write("host_tier", {"args": vars(args), "capacity": cap, "fidelity": fid}, plot)


if __name__ == "__main__":
    main()
