"""Fair share between tenants, the real server: the same settings (--max-num-seqs 32) under each policy.

Tenant A floods N requests at once (8 to 56 new tokens each, 32 on average); tenant B sends 10 one second
later. Prints, per policy, B's median time to first token, and A's throughput in a run of A's flood alone
(B idle throughout); then the ratio of B's median TTFT under fcfs to that under vtc (target >= 5x) and of
A's throughput alone, vtc / fcfs (target: not reduced, ~1).
Usage: python -m bench.bench_fairness [--flood 200] [--max-tokens 32] [--policies vtc fcfs]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from frontends import ready

CONFIG = """[auth]
admin_keys = ["sk-admin"]
[[auth.tenants]]
name = "tenant-a"
keys = ["sk-a"]
[[auth.tenants]]
name = "tenant-b"
keys = ["sk-b"]
"""


def start_server(config: Path, policy: str, max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--port", "0", "--frontends", "1",
                             "--config", str(config), "--scheduling-policy", policy,
                             "--max-num-seqs", str(max_num_seqs)], stdout=subprocess.PIPE, text=True)
    return proc, ready.wait_for(proc.stdout)["url"]


async def stream(session, url: str, key: str, prompt: str, max_tokens: int) -> tuple[float, float, list[float]]:
    """-> (start, time to first token, the arrival time of every token)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0, times = time.perf_counter(), []
    async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return t0, times[0] - t0, times


async def scenario(url: str, args, with_b: bool) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        flood = [asyncio.create_task(stream(session, url, "sk-a", f"Story {i}: once upon a time", 8 + i * 37 % 49))
                 for i in range(args.flood)]
        late = []
        if with_b:
            await asyncio.sleep(1.0)
            late = [asyncio.create_task(stream(session, url, "sk-b", f"Question {i}: why is the sky blue?",
                                               args.max_tokens)) for i in range(10)]
        a, b = await asyncio.gather(*flood), await asyncio.gather(*late)
    a_end = max(times[-1] for _, _, times in a)
    return {"b_ttft": statistics.median(ttft for _, ttft, _ in b) if b else None,
            "a_tps": sum(len(times) for _, _, times in a) / (a_end - start), "a_total_s": a_end - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--policies", nargs="+", default=["vtc", "fcfs"])
    args = p.parse_args()
    config = Path(tempfile.mkdtemp(prefix="loraplex-fairness-")) / "tenants.toml"
    config.write_text(CONFIG)
    results = {}
    for policy in args.policies:
        proc, url = start_server(config, policy, args.max_num_seqs)
        try:
            asyncio.run(stream_warmup(url))
            alone = asyncio.run(scenario(url, args, with_b=False))
            r = results[policy] = {**asyncio.run(scenario(url, args, with_b=True)), "a_alone_tps": alone["a_tps"]}
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"{policy:5s}: B's median TTFT {r['b_ttft'] * 1000:8.0f} ms (A's {args.flood} requests done in "
              f"{r['a_total_s']:.1f} s); A alone: {r['a_alone_tps']:.1f} tok/s", flush=True)
    if "vtc" in results and "fcfs" in results:
        v, f = results["vtc"], results["fcfs"]
        print(f"B's median TTFT, fcfs / vtc: {f['b_ttft'] / v['b_ttft']:.1f}x (target >= 5x); A's throughput "
              f"alone, vtc / fcfs: {v['a_alone_tps'] / f['a_alone_tps']:.2f}")


async def stream_warmup(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await stream(session, url, "sk-admin", "Hello", 4)


if __name__ == "__main__":
    main()
