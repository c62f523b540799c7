"""A streaming client that stops reading stalls no one and is aborted: after --stream-timeout when its
response waits in the (bounded) send buffers, or at once when --stream-buffer outputs pile up behind it; the
engine's pages are freed either way (--stream-timeout 3, --stream-buffer 64 here). Real processes, a tiny
random Llama."""
from __future__ import annotations

import json
import math
import socket
import struct
import time
import urllib.parse

import pytest
import requests

from tests.frontends.server_fixture import Server, metric, wait_until

BUFFER = 64       # --stream-buffer: outputs of one request that may wait for its reader


@pytest.fixture(scope="module")
def slow_server(tiny_served):
    model, adapters = tiny_served
    s = Server("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters), "--frontends", "1",
               "--stream-timeout", "3", "--stream-buffer", str(BUFFER))
    yield s
    assert s.stop() == 0


def stalled_stream(url: str, body: dict) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer and never read from it."""
    u = urllib.parse.urlparse(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((u.hostname, u.port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def metrics_of(server) -> str:
    return requests.get(server.url + "/metrics", timeout=10).text


def engine_idle(server) -> bool:
    text = metrics_of(server)
    return metric(text, "loraplex_requests_running") == 0 and metric(text, "loraplex_pool_pages", 'kind="kv"') == 0


def served_meanwhile(server) -> bool:
    r = requests.post(server.url + "/v1/completions", timeout=30,
                      json={"model": "tiny-r5", "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_reader_that_takes_nothing_is_aborted_after_the_timeout(slow_server):
    body = {"model": "model", "prompt": "Tell me everything", "max_tokens": BUFFER - 4, "n": 4, "ignore_eos": True,
            "logprobs": 20}             # 240 events of ~1.5 KB: more than the send buffers hold, less than BUFFER
    sock = stalled_stream(slow_server.url, body)
    try:
        assert served_meanwhile(slow_server)
        assert wait_until(lambda: metric(metrics_of(slow_server), "loraplex_slow_reader_aborts_total",
                                         'cause="timeout"') == 1, timeout=30)
        assert wait_until(lambda: engine_idle(slow_server), timeout=10)
        sock.settimeout(10)
        received = b""
        while chunk := sock.recv(1 << 16):            # what the buffers held, then the hang-up
            received += chunk
        assert b"[DONE]" not in received
    except ConnectionResetError:
        pass                                          # the hang-up dropped what was buffered
    finally:
        sock.close()
    assert served_meanwhile(slow_server)


def aborts(server) -> tuple[float, float]:
    text = metrics_of(server)
    counts = (metric(text, "loraplex_slow_reader_aborts_total", f'cause="{c}"') for c in ("buffer", "timeout"))
    return tuple(0.0 if math.isnan(n) else n for n in counts)      # a cause not seen yet has no sample


def test_a_reader_that_falls_stream_buffer_outputs_behind_is_aborted_and_its_pages_freed(slow_server):
    requests.post(slow_server.url + "/v1/completions", timeout=60,     # its adapter loaded: only decoding races
                  json={"model": "tiny-r8", "prompt": "Hi", "max_tokens": 1}).raise_for_status()
    tokens_before = metric(metrics_of(slow_server), "loraplex_generation_tokens_total")
    buffer_before, timeout_before = aborts(slow_server)
    wanted = 1500
    # ~1.5 KB events: the send buffers fill after ~100 of them; BUFFER more must follow within --stream-timeout
    # (3 s) of the first write that waits, for the abort to be the buffer's and not the timeout's (it was a
    # 2.5 s wait from the request, which included a cold load of tiny-r8 and failed once on a busy CI host)
    body = {"model": "tiny-r8", "prompt": "Count", "max_tokens": wanted, "ignore_eos": True, "logprobs": 20}
    sock = stalled_stream(slow_server.url, body)
    try:
        assert wait_until(lambda: aborts(slow_server) != (buffer_before, timeout_before), timeout=30)
        assert aborts(slow_server) == (buffer_before + 1, timeout_before)     # the buffer's abort, not the timeout's
        assert wait_until(lambda: engine_idle(slow_server), timeout=10)
        generated = metric(metrics_of(slow_server), "loraplex_generation_tokens_total") - tokens_before
        assert BUFFER <= generated < wanted      # aborted in the engine, not run to the end for nobody
    finally:
        sock.close()
    assert served_meanwhile(slow_server)


def test_a_client_that_hangs_up_mid_stream_is_aborted_without_an_error(slow_server):
    """A write waiting for the reader finds the connection lost (ConnectionError, "Connection lost"; or
    "Cannot write to closing transport" when it starts after the reset): the request is aborted and logged
    as gone, not as an error of ours (it was a traceback; the fuzz test caught one)."""
    seen = len(slow_server.lines)
    body = {"model": "model", "prompt": "Count", "max_tokens": BUFFER - 4, "n": 4, "ignore_eos": True,
            "logprobs": 20}                              # more than the send buffers hold: a write waits
    sock = stalled_stream(slow_server.url, body)
    sock.settimeout(30)
    got = b""
    while b"data:" not in got:
        got += sock.recv(1 << 10)
    time.sleep(1.0)                                      # the server's writes are waiting for the reader now
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()                                         # a reset, mid-stream
    assert wait_until(lambda: engine_idle(slow_server), timeout=30)
    assert served_meanwhile(slow_server)
    later = slow_server.lines[seen:]
    assert any("went away" in line for line in later), "".join(later[-40:])
    assert not [line for line in later if "Traceback" in line or "Error handling request" in line], later[-40:]
