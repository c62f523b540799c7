"""Adapter routing against random routing across Ray Serve replicas, in one run.

The same Zipf workload (s = 1, seeded) over A adapters (default 1,000) of a tiny random Llama goes through
`loraplex serve --replicas 2` three times: adapter routing bounded by load (`--replica-load-bound 1.25`),
pure adapter affinity (the default, `--replica-load-bound 0`: Ray Serve's multiplexing alone) and random
routing (`--replica-routing random`: Ray's router blind to adapters). Each replica's pool (--pool-mib,
KV and adapters) holds fewer adapters than the workload uses, so an adapter sent to a replica that lacks
it is a cold load there. Prints per
routing: cold loads per request (adapter loads into a pool, summed over the replicas), throughput, TTFT
p50 / p99, and the imbalance (max / mean requests per replica); then the ratios.
Usage: python -m bench.bench_replicas [--requests 1000] [--adapters 1000] [--concurrency 16]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

from bench.soak import zipf
from frontends import ready


def prepare(work: Path, adapters: int) -> tuple[Path, Path]:
    import torch

    from bench.adapters import write_peft_adapter
    from bench.tiny_model import make_tiny_llama
    from engine.config import ModelConfig
    from engine.model.default_model import default_model_dir
    model = make_tiny_llama(work / "model", default_model_dir(), max_positions=512)
    cfg = ModelConfig.from_dir(model, torch.float32)
    for i in range(adapters):
        write_peft_adapter(work / "adapters" / f"a{i:04d}", cfg, 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=i)
    return model, work / "adapters"


def start(model: Path, adapters: Path, routing: str, bound: float, host_tier: int,
          pool_mib: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--replicas", "2", "--port", "0",
                             "--replica-routing", routing, "--replica-load-bound", str(bound),
                             "--model", str(model), "--dtype", "float32",
                             "--adapter-dir", str(adapters), "--max-cpu-loras", str(host_tier),
                             "--max-adapters-per-replica", str(host_tier),
                             "--kv-cache-memory-bytes", str(pool_mib << 20)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = ready.wait_for(proc.stdout)["url"]
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, url


async def one(session, url: str, model: str, stats: dict) -> None:
    body = {"model": model, "prompt": "Tell me about routing", "max_tokens": 8, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        stats["replicas"][r.headers["x-loraplex-replica"]] += 1
        async for line in r.content:
            if line.startswith(b"data: {"):
                stats["ttft"].append(time.perf_counter() - t0)
                break
        async for _ in r.content:
            pass


async def workload(url: str, models: list[str], concurrency: int) -> dict:
    stats = {"replicas": collections.Counter(), "ttft": []}
    queue: asyncio.Queue = asyncio.Queue()
    for m in models:
        queue.put_nowait(m)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker():
            while not queue.empty():
                await one(session, url, queue.get_nowait(), stats)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats["seconds"] = time.perf_counter() - t0
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    stats["loads"] = sum(float(v) for v in re.findall(r"^loraplex_adapter_loads_total\{[^}]*\} (\S+)$", text, re.M))
    return stats


def run_one(model: Path, adapters: Path, routing: str, bound: float, models: list[str], args) -> dict:
    proc, url = start(model, adapters, routing, bound, args.host_tier, args.pool_mib)
    try:
        return asyncio.run(workload(url, models, args.concurrency))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--host-tier", type=int, default=256, help="--max-cpu-loras and --max-adapters-per-replica")
    p.add_argument("--pool-mib", type=int, default=4, help="each replica's page pool (KV and adapters), MiB")
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="loraplex-replicas-"))
    model, adapters = prepare(work, args.adapters)
    import random
    rng = random.Random(0)
    models = [f"a{i:04d}" for i in rng.choices(range(args.adapters), cum_weights=zipf(args.adapters), k=args.requests)]
    print(f"{args.requests} requests, Zipf over {args.adapters} adapters ({len(set(models))} distinct), 2 replicas, "
          f"host tier {args.host_tier} adapters and a {args.pool_mib} MiB pool each, concurrency {args.concurrency}",
          flush=True)
    results = {}
    for label, routing, bound in (("bounded", "adapter", 1.25), ("affinity", "adapter", 0.0),
                                  ("random", "random", 0.0)):
        s = results[label] = run_one(model, adapters, routing, bound, models, args)
        ttft = sorted(s["ttft"])
        counts = list(s["replicas"].values()) + [0] * (2 - len(s["replicas"]))
        s.update(cold=s["loads"] / args.requests, rps=args.requests / s["seconds"],
                 p50=statistics.median(ttft) * 1e3, p99=ttft[int(0.99 * (len(ttft) - 1))] * 1e3,
                 imbalance=max(counts) / (sum(counts) / 2))
        print(f"{label:>8} routing: cold loads/request {s['cold']:.3f}, {s['rps']:.1f} req/s, "
              f"TTFT p50 {s['p50']:.0f} ms p99 {s['p99']:.0f} ms, imbalance {s['imbalance']:.2f} "
              f"(requests per replica {dict(s['replicas'])})", flush=True)
    r = results["random"]
    for label in ("bounded", "affinity"):
        a = results[label]
        print(json.dumps({"routing": label, "cold_loads_random_over_this": round(r["cold"] / max(a["cold"], 1e-9), 2),
                          "throughput_this_over_random": round(a["rps"] / r["rps"], 2),
                          "ttft_p50_random_over_this": round(r["p50"] / a["p50"], 2),
                          "ttft_p99_random_over_this": round(r["p99"] / a["p99"], 2),
                          "imbalance": round(a["imbalance"], 2), "imbalance_random": round(r["imbalance"], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
