"""Schemathesis against the real processes: cases generated from `/openapi.json` (valid and invalid
bodies), at least 2,000 in all (LORAPLEX_FUZZ_SCALE=N: N times as many, for a longer hunt), sent by two
processes at once. No answer is
a 5xx, and the server logs no traceback (a bug after a stream began has no status code); every error is in
OpenAI's error shape; every success, and every event of a stream, is exactly the response type the
document declares (it decodes strictly into it, and encoding that gives back the same
JSON: no field the document lacks); the server is healthy afterwards."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from frontends import api_responses as r
from frontends import responses_api as x
from ipc.pool_report import PoolReport
from tests.frontends.server_fixture import Server

KEY = "sk-fuzz"
MODELS = ["model", "tiny-r2", "tiny-r5", "tiny-r8", None]    # None: as generated ("model": the base model's name)
SCALE = int(os.environ.get("LORAPLEX_FUZZ_SCALE", "1"))      # more cases for a longer hunt than make test's
PER_OPERATION = {op: n * SCALE for op, n in {"POST /v1/completions": 300, "POST /v1/chat/completions": 300,
                                               "POST /v1/responses": 150, "POST /v1/load_lora_adapter": 200,
                                               "POST /v1/unload_lora_adapter": 200}.items()}
# per generation mode; the GETs take no input: 5 each
RESPONSE = {"/v1/completions": r.Completion, "/v1/chat/completions": r.ChatCompletion,
            "/v1/models": r.ModelList, "/v1/load_lora_adapter": r.StatusReply,
            "/v1/unload_lora_adapter": r.StatusReply, "/health": r.StatusReply, "/v1/pool": PoolReport,
            "/tokenize": r.TokenizeReply, "/detokenize": r.DetokenizeReply, "/v1/responses": x.Response}
EVENT = {"/v1/completions": r.Completion, "/v1/chat/completions": r.ChatCompletionChunk,
         "/v1/responses": x.StreamEvent}
LAST = {"/v1/responses": ('"type":"response.completed"', '"type":"response.incomplete"')}   # else [DONE]


@pytest.fixture(scope="module")
def fuzz_server(tiny_served):
    model, adapters = tiny_served
    s = Server("--model", str(model), "--dtype", "float32", "--adapter-dir", str(adapters), "--api-key", KEY,
               "--max-model-len", "48", "--max-num-seqs", "16", "--frontends", "1")
    yield s
    assert s.stop() == 0


REASONS = collections.Counter()


def check_answer(case, resp, seen: collections.Counter, server_log: list[str]) -> None:
    seen[resp.status_code // 100] += 1
    text = resp.text
    what = (f"{case.method} {case.path} {case.body!r:.3000} -> {resp.status_code} {text[:300]} ... {text[-300:]}"
            f"\nthe server's last lines:\n{''.join(server_log[-30:])}")
    assert resp.status_code < 500, what
    sent, got = (case.headers or {}).get("X-Request-Id"), resp.headers.get("x-request-id")  # lower case, lists
    assert got and len(got) == 1 and (got[0] == sent or resp.status_code >= 400 or not sent), \
        f"X-Request-Id {sent!r} -> {got!r}: {what}"
    if resp.status_code >= 400:
        err = msgspec.json.decode(resp.content, type=r.ErrorResponse).error
        assert err.message and err.type, what
        REASONS[(case.path, resp.status_code, err.param, err.message[:50])] += 1
        return
    if resp.headers.get("content-type", [""])[0].startswith("text/event-stream"):   # stream: true
        events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
        assert events, what
        # NOTE: schemathesis stops reading a stream after 20 events (its max_stream_events) and says so on the
        # Response that case.call returns (`stream_cut_short`; the transport sets an attribute of that meaning
        # only on its own requests.Response, so reading that one here failed every stream it cut short)
        cut_short = resp.stream_cut_short
        last = LAST.get(case.path, ("[DONE]",))
        assert cut_short or any(end in events[-1] for end in last) or "error" in json.loads(events[-1]), \
            f"{len(events)} events, {what}"
        for event in events[:-1] if events[-1] == "[DONE]" else events:
            body = json.loads(event)
            assert_exactly(event.encode(), r.ErrorResponse if "error" in body else EVENT[case.path], what)
        return
    if case.path in RESPONSE:
        assert_exactly(resp.content, RESPONSE[case.path], what)


def assert_exactly(raw: bytes, type_: type, what: str) -> None:
    """raw is a `type_`: it decodes strictly into it, and nothing it has is left out of it."""
    decoded = msgspec.json.decode(raw, type=type_)
    assert json.loads(msgspec.json.encode(decoded)) == json.loads(raw), what


# the (operation, generation mode) pairs each of the two fuzzing processes takes, about half of the time each
# (the chat route's cases take the longest to generate); None: every pair of no other share
SHARES = [{"POST /v1/chat/completions positive", "POST /v1/completions positive", "POST /v1/completions negative"},
          None]


def fuzz(url: str, share: set[str] | None, log: list[str]) -> dict:
    """Generate and send the cases of the (operation, mode) pairs in `share` (None: those of no other
    share); check each answer (AssertionError on the first that fails) -> {"cases", "seen", "reasons"}."""
    doc = requests.get(url + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    session = requests.Session()
    seen, cases = collections.Counter(), collections.Counter()
    others = set().union(*(s for s in SHARES if s is not None))
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        for mode in GenerationMode:
            if mode is GenerationMode.NEGATIVE and label not in PER_OPERATION:
                continue                    # a GET without parameters has no invalid form
            pair = f"{label} {mode.value}"
            if (pair not in share) if share is not None else (pair in others):
                continue
            @given(case=op.as_strategy(generation_mode=mode), model=st.sampled_from(MODELS))
            @settings(max_examples=PER_OPERATION.get(label, 5), deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case, model):
                cases[label] += 1
                if model and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                    case.body["model"] = model      # a served model, else nearly every valid body is a 404
                case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
                resp = case.call(base_url=url, session=session, timeout=60)
                check_answer(case, resp, seen, log)
            run()
    return {"cases": dict(cases), "seen": {str(k): v for k, v in seen.items()},
            "reasons": [[list(k), v] for k, v in REASONS.most_common(12)]}


WORKER = """
import json, sys
from tests.frontends.test_fuzz_openapi import SHARES, fuzz
url, i = sys.argv[1], int(sys.argv[2])
print(json.dumps(fuzz(url, SHARES[i], [])))
"""


def test_fuzz_every_route_from_the_openapi_document(fuzz_server):
    """Two processes generate and send the cases (hypothesis's generation, not the server, is most of
    the time: one core each), half of the operations each."""
    doc = requests.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    assert set(doc["paths"]) >= set(RESPONSE) | {"/metrics", "/openapi.json"}
    root = Path(__file__).parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, fuzz_server.url, str(i)], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(len(SHARES))]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-6000:] + "\nthe server's last lines:\n" + "".join(fuzz_server.lines[-30:])
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    cases = collections.Counter()
    seen = collections.Counter()
    for res in results:
        cases.update(res["cases"])
        seen.update({int(k): v for k, v in res["seen"].items()})
    print(f"fuzz: {sum(cases.values())} cases {dict(cases)}; answers by class {dict(seen)}")
    every = {f"{m.upper()} {path}" for path, ops in doc["paths"].items() for m in ops if m in ("get", "post")}
    assert set(cases) == every, cases          # each operation fuzzed, by one of the processes
    assert sum(cases.values()) >= 2000, cases
    print("most common errors:", [res["reasons"][:6] for res in results])
    assert seen[2] > 100 and seen[4] > 500, seen     # both valid and invalid requests were exercised
    assert requests.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    errors = [line for line in fuzz_server.lines if "Traceback" in line or "Error handling request" in line]
    assert not errors, "".join(fuzz_server.lines[-60:])      # no bug of ours, also none after a stream began
    resp = requests.post(fuzz_server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": "tiny-r5", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
