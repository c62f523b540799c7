"""Do adapter loads stop the other streams? The real server at its defaults, 8 streams on the base model
(each a loop of 256-token requests, so that the step's cost stays level);
after a quiet stretch, a burst of cold loads of rank-64 adapters on all seven projections (float32 files, as
PEFT saves them), one every --every seconds, half by a request naming an adapter not loaded yet (on demand)
and half by POST /v1/load_lora_adapter followed by a request. Both sides in one run: the gaps between the
streams' chunks before the burst and while it lasts (from its first load until every load's request has
its first token, plus a second); prints p99 and longest gap of each and their ratios (goals: p99 <= 1.5x,
longest <= 3x). Writes bench/results/load_stall.json and .png (the gap timeline, loads marked).
Usage: python -m bench.bench_load_stall [--loads 12] [--streams 8] [--every 0.4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch

from bench.output import write
from bench.serving import start_server, stop_server


async def stream(session, url: str, model: str, stop: asyncio.Event, times: list[list[float]], tokens: int) -> None:
    """Requests of `tokens` tokens one after another (so the context, and the step's cost, stays the same
    over the run); times: each request's chunk arrival times."""
    body = {"model": model, "prompt": "Tell me a long story about a river.", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        times.append([])
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    times[-1].append(time.perf_counter())
                if stop.is_set():
                    return


async def cold_load(session, url: str, name: str, path: str, via_route: bool) -> dict:
    t0 = time.perf_counter()
    if via_route:
        async with session.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}) as r:
            assert r.status == 200, await r.text()
    body = {"model": name, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
    return {"name": name, "via": "route" if via_route else "on demand", "start": t0, "end": time.perf_counter()}


def gaps(times_per_stream: list[list[float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """(time, gap) for every chunk that arrived in [lo, hi), over all streams."""
    out = []
    for ts in times_per_stream:
        out += [(b, b - a) for a, b in zip(ts, ts[1:]) if lo <= b < hi]
    return out


async def run(url: str, dirs: list[Path], args) -> dict:
    stop = asyncio.Event()
    times = [[] for _ in range(args.streams)]     # per stream, per request: chunk times
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async with session.get(url + "/v1/models") as r:
            base = (await r.json())["data"][0]["id"]
        tasks = [asyncio.create_task(stream(session, url, base, stop, t, args.tokens)) for t in times]
        await asyncio.sleep(args.warmup)
        t_before = time.perf_counter()
        await asyncio.sleep(args.quiet)
        loads = []
        t_burst = time.perf_counter()
        for i, d in enumerate(dirs):
            loads.append(asyncio.create_task(cold_load(session, url, d.name, str(d), via_route=i % 2 == 1)))
            await asyncio.sleep(args.every)
        loads = [await t for t in loads]
        t_end = max(x["end"] for x in loads) + 1.0
        await asyncio.sleep(max(0.0, t_end - time.perf_counter()))
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    times = [req for per_stream in times for req in per_stream]
    assert sum(map(len, times)) > 100, "the streams received nothing"
    before, during = gaps(times, t_before, t_burst), gaps(times, t_burst, t_end)
    return {"before": before, "during": during, "loads": loads, "t0": t_before}


def summary(res: dict) -> dict:
    b = np.array([g for _, g in res["before"]]) * 1e3
    d = np.array([g for _, g in res["during"]]) * 1e3
    out = {"p99_before_ms": float(np.percentile(b, 99)), "p99_during_ms": float(np.percentile(d, 99)),
           "max_before_ms": float(b.max()), "max_during_ms": float(d.max()),
           "median_before_ms": float(np.median(b)), "median_during_ms": float(np.median(d)),
           "cold_load_to_first_token_ms": [round(1e3 * (x["end"] - x["start"]), 1) for x in res["loads"]]}
    out["p99_ratio"] = out["p99_during_ms"] / out["p99_before_ms"]
    out["max_ratio"] = out["max_during_ms"] / out["max_before_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", type=int, default=12)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream request (then the next one)")
    p.add_argument("--every", type=float, default=0.4, help="seconds between two cold loads")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--quiet", type=float, default=6.0, help="seconds of streaming measured before the burst")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="folder for the JSON and PNG (bench/results)")
    p.add_argument("server_args", nargs="*", help="extra `loraplex serve` flags (none: the defaults)")
    args = p.parse_args()
    from bench.adapters import write_peft_adapter
    from engine.config import EngineConfig
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-load-stall")
    cfg = EngineConfig.create().model
    dirs = [write_peft_adapter(work / f"cold{i}", cfg, args.rank, seed=30_000 + i, dtype=torch.float32)
            for i in range(args.loads)]
    proc, url = start_server(["--adapter-dir", str(work), *args.server_args])
    try:
        res = asyncio.run(run(url, dirs, args))
    finally:
        stop_server(proc)
    s = summary(res)
    mb = dirs[0].joinpath("adapter_model.safetensors").stat().st_size / 1e6
    print(f"{args.streams} base streams; {args.loads} cold loads of rank-{args.rank} all-projection adapters "
          f"({mb:.0f} MB float32 files), one every {args.every} s; server flags: {args.server_args or 'defaults'}")
    print(f"gap between chunks  before: median {s['median_before_ms']:.1f} ms, p99 {s['p99_before_ms']:.1f} ms, "
          f"longest {s['max_before_ms']:.1f} ms")
    print(f"                    during: median {s['median_during_ms']:.1f} ms, p99 {s['p99_during_ms']:.1f} ms, "
          f"longest {s['max_during_ms']:.1f} ms")
    print(f"p99 ratio {s['p99_ratio']:.2f}x (goal <= 1.5x), longest ratio {s['max_ratio']:.2f}x (goal <= 3x)")
    print(f"cold load -> first token (ms): {s['cold_load_to_first_token_ms']}")
    t0 = res["t0"]

    def plot(ax):
        for label, pts in (("before", res["before"]), ("during the loads", res["during"])):
            ax.scatter([t - t0 for t, _ in pts], [1e3 * g for _, g in pts], s=3, label=label)
        for i, x in enumerate(res["loads"]):
            ax.axvline(x["start"] - t0, color="red", lw=0.6, ls="--", label="a cold load starts" if i == 0 else None)
        ax.set_xlabel("seconds")
        ax.set_ylabel("gap between chunks (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(f"bench_load_stall: p99 gap {s['p99_ratio']:.2f}x, longest {s['max_ratio']:.2f}x during loads")
    write("load_stall", {"args": vars(args), "summary": s, "loads": res["loads"],
                         "gaps_before": res["before"], "gaps_during": res["during"]}, plot, args.out)
    print(json.dumps({k: round(v, 3) for k, v in s.items() if isinstance(v, float)}))


if __name__ == "__main__":
    main()
