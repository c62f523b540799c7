"""`loraplex run-batch -i IN.jsonl -o OUT.jsonl [engine flags]`: a file in OpenAI's Batch API format, run
through the server itself (vLLM's `run-batch`): nightly evaluations of every tenant's adapter, bulk
labelling, anything that need not stream.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`, whose body may name any adapter as its `model`. The command starts
`loraplex serve` on a free local port (one frontend; the engine flags given: --model, --adapter-dir, ...),
sends the lines at most --max-concurrency at a time (a 429 is retried after its Retry-After), and writes one
line per input line, in the input's order, each as soon as it and every earlier one are answered:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, the body being
exactly the server's answer (an error body for a refused request); a line that cannot be sent (not JSON,
no custom_id, one used twice, another method or url, `stream`) gets `"response": null` and
`"error": {"code", "message"}` naming what is wrong. Blank lines are skipped.
Exit status 0 once every line has its answer, whatever they say; 2 when the input cannot be read or the
server does not start.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from frontends import ready
from frontends.argv import drop_flags

URLS = ("/v1/completions", "/v1/chat/completions")
OWN_FLAGS = {"-i", "--input", "-o", "--output", "--max-concurrency"}


@dataclass
class Line:
    number: int                    # 1-based, in the input file
    custom_id: str | None
    url: str = ""
    body: dict | None = None
    error: str | None = None       # why it cannot be sent


def parse_lines(text: str) -> list[Line]:
    """The input's non-blank lines, each checked (Line.error names the first problem)."""
    out, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        out.append(line := _parse(number, raw))
        if line.error is None and line.custom_id in seen:
            line.error = f"line {number}: custom_id {line.custom_id!r} is used by an earlier line"
        seen.add(line.custom_id)
    return out


def _parse(number: int, raw: str) -> Line:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as e:
        return Line(number, None, error=f"line {number}: not JSON: {e}")
    if not isinstance(item, dict):
        return Line(number, None, error=f"line {number}: not a JSON object")
    cid = item.get("custom_id")
    line = Line(number, cid if isinstance(cid, str) else None, item.get("url", ""), item.get("body"))
    if not isinstance(cid, str) or not cid:
        line.error = f"line {number}: 'custom_id' must be a non-empty string"
    elif item.get("method") != "POST":
        line.error = f"line {number}: 'method' must be \"POST\", got {item.get('method')!r}"
    elif line.url not in URLS:
        line.error = f"line {number}: 'url' must be one of {', '.join(URLS)}, got {line.url!r}"
    elif not isinstance(line.body, dict):
        line.error = f"line {number}: 'body' must be a JSON object"
    elif line.body.get("stream"):
        line.error = f"line {number}: 'stream' is not supported in a batch (each answer is written whole)"
    return line


def result(line: Line, status: int | None = None, request_id: str | None = None, body=None) -> dict:
    """The output line of `line`: its answer, or (status None) the reason it was not sent."""
    out = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id}
    if status is None:
        return {**out, "response": None, "error": {"code": "invalid_request", "message": line.error}}
    return {**out, "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


async def send_all(url: str, lines: list[Line], concurrency: int, progress=None, write=None) -> list[dict]:
    """Every line's output, in order; at most `concurrency` requests in flight. write(output): called for
    each line's output in the input's order as soon as it and every earlier one are done (a long batch's
    answers reach the file as they come, not all at the end)."""
    import aiohttp
    gate = asyncio.Semaphore(concurrency)
    done: list[dict | None] = [None] * len(lines)
    written = 0

    def finished(i: int, out: dict) -> dict:
        nonlocal written
        done[i] = out
        while write is not None and written < len(done) and done[written] is not None:
            write(done[written])
            written += 1
        return out

    async def one(session, line: Line) -> dict:
        if line.error is not None:
            return result(line)
        async with gate:
            try:
                while True:
                    async with session.post(url + line.url, json=line.body) as r:
                        body = await r.json(content_type=None)
                        if r.status != 429:
                            return result(line, r.status, r.headers.get("X-Request-Id"), body)
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))     # backpressure, not an answer
            except (aiohttp.ClientError, ValueError) as e:        # the server went away, or answered garbage
                return {**result(line), "error": {"code": "server_error", "message": f"line {line.number}: {e}"}}

    async def numbered(session, i: int, line: Line) -> dict:
        out = finished(i, await one(session, line))
        if progress is not None:
            progress.update(1)
        return out

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        return await asyncio.gather(*(numbered(session, i, line) for i, line in enumerate(lines)))


def serve_argv(argv: list[str]) -> list[str]:
    """The run-batch command line without its own flags: the engine flags `loraplex serve` gets."""
    return [a for a in drop_flags(argv, OWN_FLAGS) if a != "run-batch"]


class Server:
    """`loraplex serve` on a free local port, its output passed on to our stderr."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "frontends.cli", "serve", "--port", "0", "--frontends",
                                      "1", *args], stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
        try:
            self.url = ready.wait_for(self.proc.stdout)["url"]
        except RuntimeError:
            self.proc.wait()
            raise RuntimeError(f"the server did not start (exit status {self.proc.returncode})") from None
        threading.Thread(target=lambda: [sys.stderr.write(x) for x in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run(args) -> int:
    """`loraplex run-batch` (frontends/cli.py)."""
    from tqdm import tqdm
    if args.max_concurrency < 1:
        print(f"loraplex: error: --max-concurrency must be >= 1, got {args.max_concurrency}", file=sys.stderr)
        return 2
    try:
        text = sys.stdin.read() if args.input == "-" else open(args.input, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"loraplex: error: --input {args.input}: {e}", file=sys.stderr)
        return 2
    lines = parse_lines(text)
    try:
        out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    except OSError as e:
        print(f"loraplex: error: --output {args.output}: {e}", file=sys.stderr)
        return 2
    try:
        server = Server(serve_argv(args.argv))
    except RuntimeError as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        return 2

    def write(result: dict) -> None:
        out.write(json.dumps(result) + "\n")
        out.flush()
    try:
        with tqdm(total=len(lines), desc="run-batch", unit="req", file=sys.stderr) as bar:
            results = asyncio.run(send_all(server.url, lines, args.max_concurrency, bar, write))
    finally:
        server.stop()
        if out is not sys.stdout:
            out.close()
    bad = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"loraplex: run-batch: {len(results)} lines, {len(results) - bad} answered 200, {bad} not "
          f"(their lines say why)", file=sys.stderr)
    return 0
