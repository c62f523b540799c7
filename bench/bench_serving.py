"""Online load against the real server at its defaults: Poisson arrivals, Zipf adapter popularity, streaming.

Starts `loraplex serve` itself (no flags but --adapter-dir), and in one run sends --requests requests at
--rate per second twice, with the same arrival times: each naming an adapter drawn from Zipf(--zipf) over
--adapters adapters (rank 8 / 16 on q and v), then each naming one single adapter. Each side has prompts of
its own (random words of their own seed), so neither finds the other's in the prefix cache; both print how
many prompt tokens were served from it. Prints throughput and
time-to-first-token / inter-token latency p50 and p99 of both, and the ratios (goals: throughput >= 0.95x,
TTFT p99 within 1.5x of one adapter's); writes bench/results/serving.json and .png.
`--rates 10,13,16`: a sweep, each rate with 100 adapters of its own (loaded cold), both ratios against the rate
(bench/results/serving_sweep.json and .png).
Usage: python -m bench.bench_serving [--requests 300] [--rate 16] [--rates R1,R2,..] [--adapters 100] [--url URL]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np


def zipf_picks(n: int, k: int, s: float, rng: random.Random) -> list[int]:
    weights = [1.0 / (i + 1) ** s for i in range(k)]
    return rng.choices(range(k), weights=weights, k=n)


async def one(session, url, model, prompt, max_tokens, stats, first: bool = False) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last, ttft, itl, tokens = None, None, [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            stats["errors"] += 1
            return
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:            # the usage chunk, last
                stats["prompt_tokens"] += chunk["usage"]["prompt_tokens"]
                stats["cached_tokens"] += (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                continue
            now = time.perf_counter()
            if chunk["choices"][0]["text"]:
                tokens += 1
            if last is None:
                ttft = now - t0
            else:
                itl.append(now - last)
            last = now
    stats["ttft"].append(ttft)
    stats["ttft_first" if first else "ttft_rest"].append(ttft)   # the first request naming its adapter, or not
    stats["itl"] += itl
    stats["chunks"] += tokens
    stats["e2e"].append(time.perf_counter() - t0)


async def run_load(url: str, models: list[str], args, prompts: str) -> dict:
    """args.requests requests: the arrival times and Zipf picks of args.seed (the same for every call), the
    prompts of `prompts` (a seed of their own: a run's second side must not find the first side's prompts
    in the prefix cache, which a same-seeded run did for the adapter both sides name)."""
    rng, words_rng = random.Random(args.seed), random.Random(f"{args.seed}-{prompts}")
    picks = zipf_picks(args.requests, len(models), args.zipf, rng)
    stats = {"ttft": [], "ttft_first": [], "ttft_rest": [], "itl": [], "e2e": [], "chunks": 0, "errors": 0,
             "prompt_tokens": 0, "cached_tokens": 0}
    seen: set[int] = set()
    words = "the river city market story light garden music winter morning".split()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(args.requests):
            prompt = " ".join(words_rng.choice(words) for _ in range(args.prompt_words))
            tasks.append(asyncio.create_task(one(session, url, models[picks[i]], prompt, args.max_tokens, stats,
                                                 picks[i] not in seen)))
            seen.add(picks[i])
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
        stats["wall"] = time.perf_counter() - t0
    return stats


def report(stats: dict, args) -> None:
    pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    done = len(stats["e2e"])
    print(f"requests {done} ok, {stats['errors']} errors, in {stats['wall']:.1f} s (arrival rate {args.rate}/s, "
          f"Zipf({args.zipf}) over {args.adapters} adapters)")
    print(f"output throughput : {done * args.max_tokens / stats['wall']:.1f} tok/s, "
          f"{done / stats['wall']:.2f} req/s")
    print(f"TTFT   p50 {pct(stats['ttft'], 50):8.1f} ms   p99 {pct(stats['ttft'], 99):8.1f} ms")
    print(f"TTFT   p50 {pct(stats['ttft_first'], 50):8.1f} ms   p90 {pct(stats['ttft_first'], 90):8.1f} ms   of the "
          f"{len(stats['ttft_first'])} requests first to name their adapter; the others p50 "
          f"{pct(stats['ttft_rest'], 50):.1f} ms, p90 {pct(stats['ttft_rest'], 90):.1f} ms")
    print(f"ITL    p50 {pct(stats['itl'], 50):8.1f} ms   p99 {pct(stats['itl'], 99):8.1f} ms")
    print(f"E2E    p50 {pct(stats['e2e'], 50):8.1f} ms   p99 {pct(stats['e2e'], 99):8.1f} ms")
    print(f"prompt tokens {stats['prompt_tokens']}, {stats['cached_tokens']} of them from the prefix cache")


def summary(stats: dict, args) -> dict:
    pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    done = len(stats["e2e"])
    return {"ok": done, "errors": stats["errors"], "tok_s": done * args.max_tokens / stats["wall"],
            "ttft_p50_ms": pct(stats["ttft"], 50), "ttft_p99_ms": pct(stats["ttft"], 99),
            "itl_p50_ms": pct(stats["itl"], 50), "itl_p99_ms": pct(stats["itl"], 99),
            "ttft_first_p50_ms": pct(stats["ttft_first"], 50), "ttft_first_p90_ms": pct(stats["ttft_first"], 90),
            "ttft_rest_p50_ms": pct(stats["ttft_rest"], 50), "ttft_rest_p90_ms": pct(stats["ttft_rest"], 90),
            "prompt_tokens": stats["prompt_tokens"], "cached_tokens": stats["cached_tokens"]}


def sweep_plot(ax, sweep: list[dict], args) -> None:
    """--rates: both ratios against the arrival rate, the goals drawn in."""
    rates = [r["rate"] for r in sweep]
    ax.plot(rates, [r["throughput_ratio"] for r in sweep], "o-", label=f"throughput, {args.adapters} adapters / 1")
    ax.plot(rates, [r["ttft_p99_ratio"] for r in sweep], "s-", label=f"TTFT p99, {args.adapters} adapters / 1")
    ax.axhline(0.95, color="C0", ls=":", lw=1)
    ax.axhline(1.5, color="C1", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("arrivals per second (Poisson)")
    ax.set_ylabel("ratio")
    ax.legend()
    ax.set_title(f"bench_serving --rates: {args.requests} requests a rate, each rate's {args.adapters} adapters "
                 f"loaded cold")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (else one is started at its defaults)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=16.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--rates", default=None, help="a sweep instead, e.g. 10,13,16: each rate both sides, each "
                   "with 100 adapters of its own (loaded cold, as at the first rate); writes serving_sweep")
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    p.add_argument("server_args", nargs="*", help="extra `loraplex serve` flags (none: the defaults)")
    args = p.parse_args()
    from bench.adapters import write_peft_adapter
    from bench.output import write
    from bench.serving import start_server, stop_server
    from engine.config import EngineConfig
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-serving")
    cfg = EngineConfig.create().model
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    sets = []                      # per rate: its adapters' names (the first set: tenant0.., as always)
    for k in range(len(rates)):
        prefix = "tenant" if k == 0 else f"r{k}-tenant"
        for i in range(args.adapters):
            write_peft_adapter(work / f"{prefix}{i}", cfg, (8, 16)[i % 2], ("q_proj", "v_proj"),
                               seed=20_000 + 1_000 * k + i)
        sets.append([f"{prefix}{i}" for i in range(args.adapters)])
    proc, url = (None, args.url) if args.url else start_server(["--adapter-dir", str(work), *args.server_args])
    sweep = []
    try:
        asyncio.run(run_load(url, sets[0][:1], argparse.Namespace(**{**vars(args), 'requests': 8}), "warm-up"))
        for rate, models in zip(rates, sets):
            at = argparse.Namespace(**{**vars(args), "rate": rate})
            results = {}
            for label, names in ((f"{args.adapters} adapters", models), ("1 adapter", sets[0][:1])):
                stats = asyncio.run(run_load(url, names, at, f"{rate}-{label}"))
                print(f"--- {label}, {rate}/s")
                report(stats, at)
                results[label] = summary(stats, at)
            many, one = results.values()
            sweep.append({"rate": rate, "results": results, "throughput_ratio": many["tok_s"] / one["tok_s"],
                          "ttft_p99_ratio": many["ttft_p99_ms"] / one["ttft_p99_ms"]})
            print(f"{args.adapters} adapters vs 1 at {rate}/s: throughput {sweep[-1]['throughput_ratio']:.2f}x (goal "
                  f">= 0.95x), TTFT p99 {sweep[-1]['ttft_p99_ratio']:.2f}x (goal <= 1.5x); server flags: "
                  f"{args.server_args or 'defaults'}")
    finally:
        if proc:
            stop_server(proc)
    if args.rates:
        write("serving_sweep", {"args": vars(args), "sweep": sweep}, lambda ax: sweep_plot(ax, sweep, args))
        return
    results, tput, ttft = sweep[0]["results"], sweep[0]["throughput_ratio"], sweep[0]["ttft_p99_ratio"]

    def plot(ax):
        keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
        for k, (label, r) in enumerate(results.items()):
            ax.bar([x + 0.4 * k for x in range(len(keys))], [r[key] for key in keys], width=0.4,
                   label=f"{label}: {r['tok_s']:.0f} tok/s")
        ax.set_xticks([x + 0.2 for x in range(len(keys))], [key.replace("_ms", "") for key in keys])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.legend()
        ax.set_title(f"bench_serving: {args.requests} requests, Poisson {args.rate}/s; throughput {tput:.2f}x, "
                     f"TTFT p99 {ttft:.2f}x")
    write("serving", {"args": {k: v for k, v in vars(args).items()}, "results": results,
                      "throughput_ratio": tput, "ttft_p99_ratio": ttft}, plot)


if __name__ == "__main__":
    main()
