"""`loraplex run-batch -i IN.jsonl -o OUT.jsonl [engine flags]`: a file in OpenAI's Batch API format, run
through the server itself (vLLM's `run-batch`): nightly evaluations of every tenant's adapter, bulk
labelling, anything that need not stream.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url": "/v1/completions",
"/v1/chat/completions" or "/v1/responses", "body": {...}}`, whose body may name any adapter as its `model`.
The command starts `loraplex serve` on a free local port (one frontend; the engine flags given: --model,
--adapter-dir, ...),
sends the lines at most --max-concurrency at a time (a 429 is retried after its Retry-After), and writes one
line per input line, in the input's order, each as soon as it and every earlier one are answered:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, the body being
exactly the server's answer (an error body for a refused request); a line that cannot be sent (not JSON,
no custom_id, one used twice, another method or url, `stream`) gets `"response": null` and
`"error": {"code", "message"}` naming what is wrong. Blank lines are skipped.
Exit status 0 once every line has its answer, whatever they say; 2 when the input cannot be read or the
server does not start; 1 when writing the output (or reading the input) fails on the way.

The file is streamed, not held: lines are read as requests go out, at most WINDOW_PER_REQUEST x
--max-concurrency ahead of the last line written (a slow early line holds the reading back, so memory stays
bounded whatever the file's length); only the custom_ids seen are kept, to refuse one used twice.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from frontends import ready
from frontends.argv import drop_flags

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
OWN_FLAGS = {"-i", "--input", "-o", "--output", "--max-concurrency"}
WINDOW_PER_REQUEST = 4      # lines read but not yet written, per request allowed in flight


@dataclass
class Line:
    number: int                    # 1-based, in the input file
    custom_id: str | None
    url: str = ""
    body: dict | None = None
    error: str | None = None       # why it cannot be sent


def parse_lines(raw_lines: Iterable[bytes | str]) -> Iterator[Line]:
    """The input's non-blank lines as they are read, each checked (Line.error names the first problem)."""
    seen = set()
    for number, raw in enumerate(raw_lines, 1):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Line(number, None, error=f"line {number}: not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
        if not raw.strip():
            continue
        line = _parse(number, raw)
        if line.error is None and line.custom_id in seen:
            line.error = f"line {number}: custom_id {line.custom_id!r} is used by an earlier line"
        seen.add(line.custom_id)
        yield line


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


@dataclass
class Tally:
    lines: int = 0
    ok: int = 0                    # answered 200


async def send_all(url: str, lines: Iterable[Line], concurrency: int, progress=None,
                   write: Callable[[dict], None] = lambda out: None) -> Tally:
    """Send every line, at most `concurrency` requests in flight. write(output): called for each line's output
    in the input's order as soon as it and every earlier one are done; `lines` is consumed at most
    WINDOW_PER_REQUEST * concurrency lines ahead of the last one written. Returns the counts."""
    import aiohttp
    gate = asyncio.Semaphore(concurrency)
    room = asyncio.Semaphore(WINDOW_PER_REQUEST * concurrency)
    done: dict[int, dict] = {}     # outputs waiting for an earlier line's
    tally = Tally()

    def finished(i: int, out: dict) -> None:
        done[i] = out
        while tally.lines in done:
            out = done.pop(tally.lines)
            write(out)
            tally.lines += 1
            tally.ok += out["error"] is None and out["response"]["status_code"] == 200
            room.release()
            if progress is not None:
                progress.update(1)

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
            except Exception as e:  # noqa: BLE001 - the server went away or answered garbage: this line says so
                return {**result(line), "error": {"code": "server_error", "message": f"line {line.number}: {e}"}}

    broken: list[BaseException] = []   # write() failed (the output's disk full, its reader gone): stop

    async def numbered(session, i: int, line: Line) -> None:
        try:
            finished(i, await one(session, line))
        except Exception as e:  # noqa: BLE001 - raised again below, once the sending has stopped
            broken.append(e)
            room.release()

    running: set[asyncio.Task] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for i, line in enumerate(lines):
            await room.acquire()
            if broken:
                break
            task = asyncio.create_task(numbered(session, i, line))
            running.add(task)
            task.add_done_callback(running.discard)
        if broken:
            for task in running:
                task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    if broken:
        raise broken[0]
    return tally


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
        total = None if args.input == "-" else _count(args.input)
        src = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    except OSError as e:
        print(f"loraplex: error: --input {args.input}: {e}", file=sys.stderr)
        return 2
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
        with tqdm(total=total, desc="run-batch", unit="req", file=sys.stderr) as bar:
            tally = asyncio.run(send_all(server.url, parse_lines(src), args.max_concurrency, bar, write))
    except OSError as e:                                  # the output cannot take more, or the input went bad
        print(f"loraplex: error: run-batch stopped: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        for f in (src, out):
            if f not in (sys.stdin.buffer, sys.stdout):
                f.close()
    print(f"loraplex: run-batch: {tally.lines} lines, {tally.ok} answered 200, {tally.lines - tally.ok} not "
          f"(their lines say why)", file=sys.stderr)
    return 0


def _count(path: str) -> int:
    """The file's non-blank lines (the progress bar's total), read once ahead in binary: cheap next to a request."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())
