"""SIGTERM to `loraplex serve` drains: the frontends stop taking connections at once, the requests running
finish whole (the engine still serves them), then every process exits and the launcher returns 0."""
from __future__ import annotations

import json
import signal
import threading
import time

import requests

from tests.frontends.server_fixture import Server, stream_running, wait_until


def refused(url: str) -> bool:
    try:
        requests.get(url + "/health", timeout=2)
    except requests.ConnectionError:
        return True
    return False


def test_sigterm_lets_running_streams_finish_and_takes_no_new_connection(tiny_served):
    model, _ = tiny_served
    s = Server("--model", str(model), "--dtype", "float32", "--frontends", "2", "--shutdown-timeout", "60")
    n = 600            # long enough to outlast the SIGTERM and the refusal (~10 ms a token here)
    body = {"model": requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"],
            "prompt": "Once upon a time", "max_tokens": n, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    got: list[tuple[float, bytes]] = []          # (arrival, line) of the stream, read on its own thread

    def read():
        with requests.post(s.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            got.extend((time.monotonic(), line) for line in r.iter_lines() if line)
    reader = threading.Thread(target=read)
    reader.start()
    assert wait_until(lambda: len(got) > 0, timeout=30)
    s.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: refused(s.url), timeout=10), "a new connection was still taken while draining"
    refused_at = time.monotonic()
    reader.join(120)
    events = [json.loads(line[len(b"data: "):]) for _, line in got if line.startswith(b"data: {")]
    assert not any("error" in e for e in events), events[-2:]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == n
    assert got[-1][1] == b"data: [DONE]"
    assert got[-1][0] > refused_at, "the stream ended before new connections were refused: nothing was drained"
    assert s.proc.wait(60) == 0
    assert "loraplex: stopped" in "".join(s.lines)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_sigterm_to_every_process_at_once_still_finishes_running_streams(tiny_served):
    """As systemd (KillMode=control-group) or a terminal's Ctrl-C signal a whole group: the engine, too, gets
    the signal while streams run; it finishes the requests it admitted before it exits, and refuses new
    ones with a 503."""
    import os
    model, _ = tiny_served
    s = Server("--model", str(model), "--dtype", "float32", "--frontends", "1", "--shutdown-timeout", "60")
    engine = s.engine_pid
    n = 600            # long enough to outlast the SIGTERM and the refusal (~10 ms a token here)
    body = {"model": requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"],
            "prompt": "Once upon a time", "max_tokens": n, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    reader, got = stream_running(s.url, body)
    everyone = [s.proc.pid, *children(s.proc.pid)]
    assert engine in everyone and len(everyone) == 3
    for pid in everyone:
        os.kill(pid, signal.SIGTERM)
    reader.join(120)
    events = [json.loads(line[len(b"data: "):]) for line in got if line.startswith(b"data: {")]
    assert not any("error" in e for e in events), events[-2:]
    assert events[-1]["usage"]["completion_tokens"] == n and got[-1] == b"data: [DONE]"
    assert s.proc.wait(60) == 0
