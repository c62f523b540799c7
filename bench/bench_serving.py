"""Online load against the running server: Poisson arrivals, Zipf adapter popularity, streaming.

Starts `loraplex serve` itself (or uses --url), sends --requests requests at --rate per second, each
naming an adapter drawn from Zipf(--zipf) over --adapters adapters, and prints throughput and
time-to-first-token / inter-token latency p50 and p99.
Usage: python -m bench.bench_serving [--requests 200] [--rate 4] [--adapters 100] [--url URL]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np


def zipf_picks(n: int, k: int, s: float, rng: random.Random) -> list[int]:
    weights = [1.0 / (i + 1) ** s for i in range(k)]
    return rng.choices(range(k), weights=weights, k=n)


async def one(session, url, model, prompt, max_tokens, stats) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    last, ttft, itl, tokens = None, None, [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            stats["errors"] += 1
            return
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if json.loads(line[6:])["choices"][0]["text"]:
                tokens += 1
            if last is None:
                ttft = now - t0
            else:
                itl.append(now - last)
            last = now
    stats["ttft"].append(ttft)
    stats["itl"] += itl
    stats["chunks"] += tokens
    stats["e2e"].append(time.perf_counter() - t0)


async def run_load(url: str, models: list[str], args) -> dict:
    rng = random.Random(args.seed)
    picks = zipf_picks(args.requests, len(models), args.zipf, rng)
    stats = {"ttft": [], "itl": [], "e2e": [], "chunks": 0, "errors": 0}
    words = "the river city market story light garden music winter morning".split()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(args.requests):
            prompt = " ".join(rng.choice(words) for _ in range(args.prompt_words))
            tasks.append(asyncio.create_task(one(session, url, models[picks[i]], prompt, args.max_tokens, stats)))
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
    print(f"ITL    p50 {pct(stats['itl'], 50):8.1f} ms   p99 {pct(stats['itl'], 99):8.1f} ms")
    print(f"E2E    p50 {pct(stats['e2e'], 50):8.1f} ms   p99 {pct(stats['e2e'], 99):8.1f} ms")


def start_server(adapter_dir: Path, args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--port", "0", "--adapter-dir",
                             str(adapter_dir), "--max-loras", str(args.max_loras), "--frontends", "2"],
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        sys.stderr.write(line)
        m = re.search(r"serving .* at (http://\S+)/v1", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (else one is started)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--max-loras", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    from bench.adapters import write_peft_adapter
    from engine.config import EngineConfig
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-serving")
    cfg = EngineConfig.create().model
    for i in range(args.adapters):
        write_peft_adapter(work / f"tenant{i}", cfg, (8, 16)[i % 2], ("q_proj", "v_proj"), seed=20_000 + i)
    models = [f"tenant{i}" for i in range(args.adapters)]
    proc, url = (None, args.url) if args.url else start_server(work, args)
    try:
        report(asyncio.run(run_load(url, models, args)), args)
    finally:
        if proc:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
