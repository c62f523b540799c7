"""`loraplex run-batch` (frontends/run_batch.py): an OpenAI Batch API file through the server, one answer per
line in the input's order; lines that cannot be sent say why; a 429 is waited out, not written."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from aiohttp import web

from frontends.run_batch import WINDOW_PER_REQUEST, Line, parse_lines, send_all, serve_argv
from tests.frontends.server_fixture import stub_server


def request(cid, body, url="/v1/completions", method="POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


def test_each_line_is_checked_and_the_first_problem_named():
    text = "\n".join([request("a", {"model": "m"}), "", "{not json", "[1]", request("", {}),
                      request("a", {"model": "m"}), request("b", {}, method="GET"),
                      request("c", {}, url="/v1/embeddings"), request("d", "text"),
                      request("e", {"model": "m", "stream": True})])
    raw = text.encode() + b'\n{"custom_id": "caf\xe9"}\n'                          # latin-1, not UTF-8
    lines = list(parse_lines(raw.splitlines(keepends=True)))
    assert [line.number for line in lines] == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]      # the blank line skipped
    assert lines[0].error is None and lines[0].custom_id == "a"
    errors = [line.error for line in lines[1:]]
    for error, says in zip(errors, ("not JSON", "not a JSON object", "'custom_id' must be", "used by an earlier line",
                                    "'method' must be", "'url' must be one of", "'body' must be", "'stream' is not",
                                    "line 11: not valid UTF-8")):
        assert says in error, (says, error)
    assert errors[0].startswith("line 3:")


def test_run_batch_takes_only_its_own_flags_out_of_the_servers():
    argv = ["run-batch", "-i", "in.jsonl", "--output=out.jsonl", "--model", "M", "--max-concurrency", "8",
            "--adapter-dir", "A"]
    assert serve_argv(argv) == ["--model", "M", "--adapter-dir", "A"]


async def test_a_429_is_waited_out_and_the_answer_kept():
    calls = []

    async def completions(request: web.Request) -> web.Response:
        calls.append(await request.json())
        if len(calls) == 1:
            return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "0"})
        return web.json_response({"choices": [{"text": "ok"}]}, headers={"X-Request-Id": "req_1"})
    runner, url = await stub_server(("POST", "/v1/completions", completions))
    try:
        bad = Line(2, None, error="line 2: not JSON")
        out = []
        tally = await send_all(url, [Line(1, "a", "/v1/completions", {"model": "m"}), bad], 4, write=out.append)
    finally:
        await runner.cleanup()
    assert len(calls) == 2 and calls[0] == {"model": "m"}
    assert out[0]["custom_id"] == "a" and out[0]["error"] is None      # in the input's order, though the bad
    assert out[0]["response"] == {"status_code": 200, "request_id": "req_1", "body": {"choices": [{"text": "ok"}]}}
    assert out[1]["response"] is None and out[1]["error"] == {"code": "invalid_request", "message": "line 2: not JSON"}
    assert out[0]["id"].startswith("batch_req_") and out[0]["id"] != out[1]["id"]      # line was done first
    assert (tally.lines, tally.ok) == (2, 1)


async def test_a_slow_early_line_holds_the_reading_back_and_nothing_is_kept():
    """The file is streamed: while line 1's answer is held, the other answers finish but wait to be written,
    and no more than the window of lines is read; once it comes, every line is written in order."""
    release, pulled = asyncio.Event(), []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if body["prompt"] == "0":
            await release.wait()
        return web.json_response({"text": body["prompt"]})
    runner, url = await stub_server(("POST", "/v1/completions", completions))

    def lines():
        for i in range(200):
            pulled.append(i)
            yield Line(i + 1, str(i), "/v1/completions", {"model": "m", "prompt": str(i)})
    out = []
    try:
        task = asyncio.create_task(send_all(url, lines(), 2, write=out.append))
        for _ in range(200):
            await asyncio.sleep(0.01)
        window = WINDOW_PER_REQUEST * 2
        assert out == [] and len(pulled) == window + 1      # the window's lines, and the next waiting for room
        release.set()
        tally = await asyncio.wait_for(task, 30)
    finally:
        await runner.cleanup()
    assert [o["response"]["body"]["text"] for o in out] == [str(i) for i in range(200)]
    assert (tally.lines, tally.ok) == (200, 200)


async def test_an_output_that_cannot_be_written_stops_the_batch_with_its_error():
    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"text": "ok"})
    runner, url = await stub_server(("POST", "/v1/completions", completions))

    def write(out: dict) -> None:
        raise OSError(28, "No space left on device")
    lines = (Line(i + 1, str(i), "/v1/completions", {"model": "m"}) for i in range(1000))
    try:
        with pytest.raises(OSError, match="No space left"):
            await asyncio.wait_for(send_all(url, lines, 2, write=write), 30)
    finally:
        await runner.cleanup()
    assert next(lines).number < 100                       # it stopped reading, rather than sending them all


def test_a_batch_file_through_the_server(tiny_served, tmp_path):
    """Completions, chats and responses on the base model and on adapters, an unknown model and a broken line: every
    line answered in order, the bodies as the server gives them."""
    model, adapters = tiny_served
    lines = [request("base", {"model": "model", "prompt": "Hello", "max_tokens": 4, "temperature": 0}),
             request("chat", {"model": "tiny-r2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                     url="/v1/chat/completions"),
             "{broken",
             request("two", {"model": "tiny-r5", "prompt": "Once", "max_tokens": 3, "n": 2}),
             request("unknown", {"model": "nope", "prompt": "x"}),
             request("resp", {"model": "tiny-r8", "input": "Hi", "max_output_tokens": 3}, url="/v1/responses")]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "frontends.cli", "run-batch", "-i", str(src), "-o", str(out),
                           "--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["base", "chat", None, "two", "unknown", "resp"]
    status = [g["response"]["status_code"] if g["response"] else None for g in got]
    assert status == [200, 200, None, 200, 404, 200], got
    base, chat, broken, two, unknown, resp = got
    assert resp["response"]["body"]["object"] == "response" and resp["response"]["body"]["usage"]["output_tokens"] == 3
    assert base["response"]["body"]["object"] == "text_completion" and base["response"]["body"]["usage"][
        "completion_tokens"] == 4
    assert chat["response"]["body"]["model"] == "tiny-r2" and chat["response"]["body"]["choices"][0]["message"]
    assert len(two["response"]["body"]["choices"]) == 2
    assert "nope" in unknown["response"]["body"]["error"]["message"]
    assert broken["error"]["code"] == "invalid_request" and "line 3" in broken["error"]["message"]
    assert all(g["response"]["request_id"].startswith("req_") for g in got if g["response"])
    assert "6 lines, 4 answered 200, 2 not" in done.stderr


def test_an_input_output_or_concurrency_it_cannot_use_is_a_clear_error_before_any_server_starts(tmp_path, capsys):
    import argparse

    from frontends.run_batch import run
    src = tmp_path / "in.jsonl"
    src.write_text(request("a", {"model": "m"}) + "\n")
    for input_, output, concurrency, says in ((str(tmp_path / "missing.jsonl"), "-", 4, "--input"),
                                              (str(src), str(tmp_path / "no" / "out.jsonl"), 4, "--output"),
                                              (str(src), "-", 0, "--max-concurrency")):   # 0 would wait forever
        assert run(argparse.Namespace(input=input_, output=output, argv=[], max_concurrency=concurrency)) == 2
        assert f"loraplex: error: {says}" in capsys.readouterr().err
