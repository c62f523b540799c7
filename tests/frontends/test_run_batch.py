"""`loraplex run-batch` (frontends/run_batch.py): an OpenAI Batch API file through the server, one answer per
line in the input's order; lines that cannot be sent say why; a 429 is waited out, not written."""
from __future__ import annotations

import json
import subprocess
import sys

from aiohttp import web

from frontends.run_batch import Line, parse_lines, send_all, serve_argv
from tests.frontends.server_fixture import stub_server


def request(cid, body, url="/v1/completions", method="POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


def test_each_line_is_checked_and_the_first_problem_named():
    text = "\n".join([request("a", {"model": "m"}), "", "{not json", "[1]", request("", {}),
                      request("a", {"model": "m"}), request("b", {}, method="GET"),
                      request("c", {}, url="/v1/embeddings"), request("d", "text"),
                      request("e", {"model": "m", "stream": True})])
    lines = parse_lines(text)
    assert [line.number for line in lines] == [1, 3, 4, 5, 6, 7, 8, 9, 10]          # the blank line skipped
    assert lines[0].error is None and lines[0].custom_id == "a"
    errors = [line.error for line in lines[1:]]
    for error, says in zip(errors, ("not JSON", "not a JSON object", "'custom_id' must be", "used by an earlier line",
                                    "'method' must be", "'url' must be one of", "'body' must be", "'stream' is not")):
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
        written = []
        out = await send_all(url, [Line(1, "a", "/v1/completions", {"model": "m"}), bad], 4, write=written.append)
    finally:
        await runner.cleanup()
    assert len(calls) == 2 and calls[0] == {"model": "m"}
    assert out[0]["custom_id"] == "a" and out[0]["error"] is None
    assert out[0]["response"] == {"status_code": 200, "request_id": "req_1", "body": {"choices": [{"text": "ok"}]}}
    assert out[1]["response"] is None and out[1]["error"] == {"code": "invalid_request", "message": "line 2: not JSON"}
    assert out[0]["id"].startswith("batch_req_") and out[0]["id"] != out[1]["id"]
    assert written == out            # in the input's order, though the bad line was done first


def test_a_batch_file_through_the_server(tiny_served, tmp_path):
    """Completions and chats on the base model and on adapters, an unknown model and a broken line: every
    line answered in order, the bodies as the server gives them."""
    model, adapters = tiny_served
    lines = [request("base", {"model": "model", "prompt": "Hello", "max_tokens": 4, "temperature": 0}),
             request("chat", {"model": "tiny-r2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                     url="/v1/chat/completions"),
             "{broken",
             request("two", {"model": "tiny-r5", "prompt": "Once", "max_tokens": 3, "n": 2}),
             request("unknown", {"model": "nope", "prompt": "x"})]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "frontends.cli", "run-batch", "-i", str(src), "-o", str(out),
                           "--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["base", "chat", None, "two", "unknown"]
    status = [g["response"]["status_code"] if g["response"] else None for g in got]
    assert status == [200, 200, None, 200, 404], got
    base, chat, broken, two, unknown = got
    assert base["response"]["body"]["object"] == "text_completion" and base["response"]["body"]["usage"][
        "completion_tokens"] == 4
    assert chat["response"]["body"]["model"] == "tiny-r2" and chat["response"]["body"]["choices"][0]["message"]
    assert len(two["response"]["body"]["choices"]) == 2
    assert "nope" in unknown["response"]["body"]["error"]["message"]
    assert broken["error"]["code"] == "invalid_request" and "line 3" in broken["error"]["message"]
    assert all(g["response"]["request_id"].startswith("req_") for g in got if g["response"])
    assert "5 lines, 3 answered 200, 2 not" in done.stderr


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
