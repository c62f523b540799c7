"""Load and failure run against the real processes (`make soak`; CI runs a short version through
tests/bench/test_soak.py).

N requests (default 10,000) over A adapters (default 1,000) of a tiny random Llama, through two frontends,
from three tenants (an `[auth]` table: each tenant its own adapter names) and the admin key; half streamed,
10% of all requests abandoned by their client after the first event (they ask for ABANDONED_TOKENS, so
that none can be answered in full before its client leaves). Mid-run one frontend is killed with SIGKILL
(at 30%), then the engine (at 60%); a client whose connection fails, before the answer or in the middle of
a stream, sends its request again (up to 3 times). Afterwards every adapter is unloaded. Prints: requests
sent, completed, errored (by cause), abandoned; pages at rest; the engine's RSS after warm-up and at the
end; per tenant, the requests (and their completion tokens) clients received in full and those /metrics
counts as answered in full. Checks, exiting 1 if one fails: every request accounted for; every completed
answer has exactly the tokens asked for; zero errors; the pool at zero pages; the engine's RSS within 10% of
its warm-up; per tenant, /metrics's requests and tokens equal to what the clients received.
Usage: python -m bench.soak [--requests 10000] [--adapters 1000] [--concurrency 48] [--work DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from frontends import ready

TENANTS = ("acme", "globex", "initech")
ADMIN = "sk-admin"


def prepare(work: Path, adapters: int) -> tuple[Path, Path, Path]:
    """The tiny model, `adapters` PEFT adapters named <tenant>-<i> (round robin), the config file."""
    import torch

    from bench.adapters import write_peft_adapter
    from bench.tiny_model import make_tiny_llama
    from engine.config import ModelConfig
    from engine.model.default_model import default_model_dir
    model = make_tiny_llama(work / "model", default_model_dir(), max_positions=512)
    cfg = ModelConfig.from_dir(model, torch.float32)
    for i in range(adapters):
        write_peft_adapter(work / "adapters" / adapter_name(i), cfg, 4, ("q_proj", "v_proj"), seed=i, std=0.2)
    tenants = "".join(f'[[auth.tenants]]\nname = "{t}"\nkeys = ["sk-{t}"]\nadapters = ["{t}-*"]\n' for t in TENANTS)
    config = work / "soak.toml"
    config.write_text(f'[auth]\nadmin_keys = ["{ADMIN}"]\n{tenants}')
    return model, work / "adapters", config


def adapter_name(i: int) -> str:
    return f"{TENANTS[i % len(TENANTS)]}-{i:04d}"


class Server:
    def __init__(self, model: Path, adapters: Path, config: Path, max_num_seqs: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontends.cli", "serve", "--port", "0", "--frontends", "2", "--model", str(model),
             "--dtype", "float32", "--adapter-dir", str(adapters), "--config", str(config),
             "--max-num-seqs", str(max_num_seqs), "--max-loras", "16", "--stream-timeout", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        info = ready.wait_for(self.proc.stdout, lambda line: None)
        self.url, self.address = info["url"], info["engine_address"]
        self.log: list[str] = []
        asyncio.get_running_loop().run_in_executor(None, self._drain)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def pid(self, what: str) -> int | None:
        pattern = {"engine": f"engine.serving.engine_proc --address {self.address}",
                   "frontend": f"--engine-address {self.address} .*--frontend-id http-0( |$)"}[what]
        out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else None

    def kill(self, what: str) -> None:
        pid = self.pid(what)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def rss_mib(self, what: str) -> float:
        pid = self.pid(what)
        while pid is None:                      # being restarted
            time.sleep(0.2)
            pid = self.pid(what)
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


ABANDONED_TOKENS = 400    # an abandoned stream cannot finish before its client reads the first event


class Tally:
    def __init__(self):
        self.outcomes: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.by_tenant: collections.Counter = collections.Counter()   # completed, by tenant name
        self.tokens_by_tenant: collections.Counter = collections.Counter()   # their completion tokens
        self.wrong: list[str] = []
        self.retries = 0


def zipf(n: int) -> list[float]:
    """Cumulative weights of Zipf's law (s = 1) over n ranks."""
    return list(itertools.accumulate(1 / k for k in range(1, n + 1)))


async def one(session, url: str, i: int, rng: random.Random, tally: Tally, n_adapters: int) -> None:
    """One client request: a tenant, one of its adapters (Zipf over them; the admin key over all)."""
    tenant = rng.choice(TENANTS + ("admin",))
    if tenant == "admin":
        key, model = ADMIN, adapter_name(rng.choices(range(n_adapters), cum_weights=zipf(n_adapters))[0])
    else:
        t, per = TENANTS.index(tenant), n_adapters // len(TENANTS)
        k = rng.choices(range(per), cum_weights=zipf(per))[0]
        key, model = f"sk-{tenant}", adapter_name(k * len(TENANTS) + t)
    max_tokens, stream = rng.randint(4, 16), rng.random() < 0.5
    abandon = stream and rng.random() < 0.2            # 10% of all requests
    if abandon:
        max_tokens = ABANDONED_TOKENS
    body = {"model": model, "prompt": f"request {i}: tell a story", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.8, "seed": i, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}"}
    for attempt in range(3):
        try:
            outcome = await _send(session, url, body, headers, abandon)
            break
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            if attempt == 2:
                tally.outcomes["errored"] += 1
                where = "mid-stream" if getattr(e, "answered", False) else "before the answer"
                tally.errors[f"connection lost {where}, 3 times ({type(e).__name__})"] += 1
                return
            tally.retries += 1
            await asyncio.sleep(0.5)
    kind, detail = outcome
    if kind == "completed" and detail != max_tokens:
        tally.wrong.append(f"request {i}: asked {max_tokens} tokens, got {detail}")
        kind = "wrong"
    tally.outcomes[kind] += 1
    if kind == "errored":
        tally.errors[detail] += 1
    if kind == "completed":
        tally.by_tenant[tenant] += 1
        tally.tokens_by_tenant[tenant] += detail


async def _send(session, url: str, body: dict, headers: dict, abandon: bool) -> tuple[str, object]:
    """-> ("completed", tokens) | ("errored", cause) | ("abandoned", None). A connection error after the
    answer began is raised with .answered set."""
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            err = (await r.json())["error"]
            return "errored", f"{r.status} {err['type']}: {err['message'][:60]}"
        try:
            if not body["stream"]:
                return "completed", (await r.json())["usage"]["completion_tokens"]
            tokens, done = None, False
            async for line in r.content:
                if abandon:
                    return "abandoned", None                   # leaving the block closes the connection
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "errored", f"in stream: {event['error']['message'][:60]}"
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            return ("completed", tokens) if done else ("errored", "stream ended without [DONE]")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            e.answered = True
            raise aiohttp.ClientConnectionError(str(e)) if isinstance(e, aiohttp.ClientPayloadError) else e


async def metrics(session, url: str) -> str:
    async with session.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.text()


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(?:\{\})?") + r" (\S+)$"
    m = re.search("^" + pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


async def until_idle(session, url: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = await metrics(session, url)
            if sample(text, "loraplex_requests_running") == 0 and sample(text, "loraplex_requests_waiting") == 0 \
                    and sample(text, "loraplex_pool_pages", 'kind="kv"') == 0:
                return text
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not come back to idle")
        await asyncio.sleep(0.5)


async def run(args) -> int:
    work = Path(args.work or tempfile.mkdtemp(prefix="loraplex-soak-"))
    t0 = time.monotonic()
    model, adapter_dir, config = prepare(work, args.adapters)
    print(f"soak: prepared {args.adapters} adapters in {time.monotonic() - t0:.0f} s ({work})", flush=True)
    server = Server(model, adapter_dir, config, args.max_num_seqs)
    tally, rng = Tally(), random.Random(args.seed)
    rss: dict[str, float] = {}
    done = 0
    conn = aiohttp.TCPConnector(limit=args.concurrency, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            queue: asyncio.Queue = asyncio.Queue()
            for i in range(args.requests):
                queue.put_nowait(i)
            marks = {int(args.requests * 0.1): "warm", int(args.requests * 0.3): "kill frontend",
                     int(args.requests * 0.6): "kill engine", int(args.requests * 0.7): "warm again"}

            async def worker():
                nonlocal done
                while not queue.empty():
                    i = queue.get_nowait()
                    await one(session, server.url, i, random.Random(rng.random()), tally, args.adapters)
                    done += 1
                    event = marks.pop(done, None)
                    if event == "warm":
                        rss["engine after warm-up"] = server.rss_mib("engine")
                    elif event == "kill frontend":
                        print(f"soak: {done} done; SIGKILL to frontend http-0", flush=True)
                        server.kill("frontend")
                    elif event == "kill engine":
                        print(f"soak: {done} done; SIGKILL to the engine", flush=True)
                        server.kill("engine")
                    elif event == "warm again":
                        rss["engine after restart and warm-up"] = server.rss_mib("engine")
            start = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            elapsed = time.monotonic() - start
            text = await until_idle(session, server.url)
            rss["engine at the end"] = server.rss_mib("engine")
            counted = {t: (sample(text, "loraplex_tenant_requests_total", f'finish_reason="length",tenant="{t}"'),
                           sample(text, "loraplex_tenant_tokens_total", f'kind="completion",tenant="{t}"'))
                       for t in (*TENANTS, "admin")}
            names = await unload_all(session, server.url)
            text = await until_idle(session, server.url)
            pages = {k: sample(text, "loraplex_pool_pages", f'kind="{k}"') for k in ("kv", "adapter")}
    finally:
        server.stop()
    return report(args, tally, elapsed, rss, counted, pages, names)


async def unload_all(session, url: str) -> int:
    """Unload every adapter (the admin key): then no adapter page may remain in the pool."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with session.get(url + "/v1/models", headers=headers) as r:
        names = [m["id"] for m in (await r.json())["data"] if m["parent"] is not None]
    for name in names:
        async with session.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers) as r:
            assert r.status == 200, await r.text()
    return len(names)


def report(args, tally: Tally, elapsed: float, rss: dict, counted: dict, pages: dict, unloaded: int) -> int:
    o = tally.outcomes
    print(f"soak: {args.requests} requests over {args.adapters} adapters in {elapsed:.0f} s "
          f"({args.requests / elapsed:.0f} req/s, concurrency {args.concurrency}, 2 frontends)")
    print(f"  completed {o['completed']}, errored {o['errored']}, abandoned {o['abandoned']}, wrong {o['wrong']}; "
          f"retried after a failed connection: {tally.retries}")
    for cause, n in tally.errors.most_common():
        print(f"    error x{n}: {cause}")
    print(f"  pages at rest after unloading {unloaded} adapters: kv {pages['kv']:.0f}, adapter {pages['adapter']:.0f}")
    for what, mib in rss.items():
        print(f"  RSS {what}: {mib:.0f} MiB")
    growth = rss["engine at the end"] / rss["engine after restart and warm-up"] - 1
    print(f"  engine RSS growth since its warm-up: {100 * growth:+.1f}%")
    agree = all(counted[t] == (tally.by_tenant[t], tally.tokens_by_tenant[t]) for t in counted)
    for t in counted:
        print(f"  tenant {t}: {tally.by_tenant[t]} received in full by clients ({tally.tokens_by_tenant[t]} tokens), "
              f"{counted[t][0]:.0f} answered in full by /metrics ({counted[t][1]:.0f} tokens)")
    checks = {"every request accounted for": sum(o.values()) == args.requests,
              "no wrong token count": not tally.wrong, "pool at zero pages": pages == {"kv": 0, "adapter": 0},
              "engine RSS within 10%": abs(growth) <= 0.10, "metrics equal what clients received": agree,
              "no errors": o["errored"] == 0}
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    for w in tally.wrong[:5]:
        print("   ", w)
    return 0 if all(checks.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--adapters", type=int, default=1_000)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the model and adapters (kept; reused when present)")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
