"""Each dense family against Llama at the default model's size, in one run: a random model of each dense
family of FULL_SIZE (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) with SmolLM2-135M's sizes
(bench/tiny_model.py: make_family_like; built once under LORAPLEX_CACHE), bench_engine's workload (64
requests x (128 + 128 tokens), greedy, EOS ignored) on the engine at its defaults for each and for the
default model (Llama), the runs alternated; prints each
family's tok/s beside Llama's and the ratio (the goal: every family within 15% of Llama, i.e. >= 0.85x),
writes bench/results/families.json and .png.

Usage: python -m bench.bench_families [--repeats 2] [--out DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench import output
from bench.bench_engine import compare_models, make_prompts
from bench.tiny_model import FULL_SIZE, make_family_like


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="runs of each model, alternated; the best counts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine_args = argparse.Namespace(dtype="bfloat16", num=64, prompt_len=128, out_len=128, max_batched_tokens=2048,
                                     device="auto", backend="auto", repeats=args.repeats)
    from engine import envs
    from engine.model.resolve import resolve_model
    src, _ = resolve_model("default")
    models = {"llama": "default"}
    for family in FULL_SIZE:
        models[family] = str(make_family_like(Path(envs.cache_dir()) / "bench-families" / family, src, family))
    prompts = make_prompts(engine_args.num, engine_args.prompt_len, 49152)
    print(f"{engine_args.num} requests x ({engine_args.prompt_len} + {engine_args.out_len} tokens), bfloat16, "
          f"{torch.get_num_threads()} threads, best of {args.repeats} alternated runs; {output.host()}")
    runs = compare_models(engine_args, prompts, models)
    best = {name: max(r) for name, r in runs.items()}
    ratios = {name: best[name] / best["llama"] for name in FULL_SIZE}
    for name in FULL_SIZE:
        verdict = "within 15%" if ratios[name] >= 0.85 else "NOT within 15%"
        print(f"{name:8s}: {best[name]:7.1f} tok/s vs Llama {best['llama']:7.1f} = {ratios[name]:.2f}x ({verdict})")

    output.write("families", {"workload": "64 x (128 + 128) tokens, bf16, greedy", "runs": runs, "best": best,
                              "ratio_to_llama": ratios}, lambda ax: plot(ax, best, ratios), args.out)


def plot(ax, best: dict[str, float], ratios: dict[str, float]) -> None:
    names = list(best)
    ax.bar(names, [best[n] for n in names], color=["gray"] + ["tab:blue"] * (len(names) - 1))
    for i, n in enumerate(names):
        ax.text(i, best[n], f"{best[n]:.0f}" + ("" if n == "llama" else f"\n{ratios[n]:.2f}x"), ha="center",
                va="bottom", fontsize=8)
    ax.axhline(0.85 * best["llama"], ls="--", color="red", lw=1, label="0.85x Llama (the goal's floor)")
    ax.set_ylim(0, 1.25 * max(best.values()))
    ax.set_ylabel("output tok/s (best run)")
    ax.set_title("each family at SmolLM2-135M's size vs Llama: 64 x (128 + 128) tokens, engine defaults")
    ax.legend(fontsize=8, loc="upper right")


if __name__ == "__main__":
    main()
