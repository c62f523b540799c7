"""The real server (engine + 2 frontends as processes) through the official openai client and raw HTTP."""
import asyncio
import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import openai
import pytest
import requests

from engine.model.default_model import default_model_dir
from engine.tokenizer import load_tokenizer
from tests.frontends.conftest import API_KEY
from tests.frontends.server_fixture import metric, wait_until

BASE = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def test_completions_chat_and_streaming_with_openai_client(client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=BASE, messages=question,
                                         max_tokens=16, temperature=0)
    assert "Paris" in out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 0
    comp = client.completions.create(model=BASE, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens >= 1
    same = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=12, temperature=0)
    assert same.choices[0].message.content == text


def test_logprobs_completions_and_chat_streamed_or_not(client):
    kw = dict(model=BASE, prompt="The capital of France is", max_tokens=5, temperature=0)
    c = client.completions.create(logprobs=3, **kw).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) <= 3 and max(top.values()) >= v - 1e-6
        assert top.get(tok, v) == pytest.approx(v, abs=1e-5)      # greedy: the token is the most likely
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(logprobs=3, stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == chat.message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(bytes(t.bytes) == t.token.encode() for t in content)
    plain = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=2, temperature=0).choices[0]
    assert plain.logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=BASE, messages=msgs, max_tokens=2, top_logprobs=2)


def test_n_choices_streamed_or_not(client):
    kw = dict(model=BASE, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11, n=3)
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1, "seeds seed, seed + 1, ... give different samples"
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    texts = ["", "", ""]
    usage = None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
        usage = ch.usage or usage
    assert texts == [c.text for c in out.choices] and usage.completion_tokens == 18
    msgs = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=4, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.completions.create(model=BASE, prompt="Hi", max_tokens=2, n=17)


def test_a_batch_of_prompts_answers_each_as_its_own_call_would(client):
    """OpenAI's batched `prompt` (an array of strings, or of token-id arrays): choice p * n + i is prompt p's
    i-th, token for token what a call with that prompt alone gives (seeded sampling included), streamed or
    not; the usage counts each prompt once; echo with max_tokens 0 scores each prompt (evaluation
    harnesses send such batches)."""
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    kw = dict(model="r8-all", max_tokens=5, temperature=0.8, seed=5, n=2)
    out = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.text for c in out.choices] == [c.text for a in alone for c in a.choices]
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts = [""] * 6
    for ch in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]
    tokenizer = load_tokenizer(default_model_dir())
    ids = [tokenizer(p)["input_ids"] for p in prompts[:2]]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in out.choices[:4]]
    scored = client.completions.create(model=BASE, prompt=prompts, max_tokens=0, echo=True, logprobs=0)
    for p, c in zip(prompts, scored.choices):
        one = client.completions.create(model=BASE, prompt=p, max_tokens=0, echo=True, logprobs=0).choices[0]
        assert c.text == p and c.logprobs.token_logprobs == one.logprobs.token_logprobs
    assert scored.usage.completion_tokens == 0


@pytest.mark.parametrize("prompt, says", [
    (["a", [1, 2]], "one kind"),
    ([[1], "a"], "one kind"),
    (["x"] * 65, "at most 64"),
    (["Hello", "word " * 10000], "prompt 1 of the batch: the prompt is"),
    ([[1, 2], []], "prompt 1 of the batch: the prompt is empty"),
    ([[1], [10 ** 9]], "prompt 1 of the batch: token id 1000000000"),
])
def test_a_bad_batch_of_prompts_gets_400_naming_the_prompt(client, prompt, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=prompt, max_tokens=2)
    assert says in e.value.body["message"] and e.value.body["param"] == "prompt"


def test_model_is_an_adapter_name(client):
    models = {m.id for m in client.models.list().data}
    assert {BASE, "r4-qv", "r8-all", "r16-attn"} <= models
    kw = dict(prompt="The weather today is", max_tokens=10, temperature=0)
    base = client.completions.create(model=BASE, **kw).choices[0].text
    tuned = client.completions.create(model="r8-all", **kw).choices[0].text
    assert tuned != base
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="r8-all", stream=True, **kw))
    assert streamed == tuned


def test_two_frontends_stream_at_once_with_different_adapters(server_fp32):
    server = server_fp32
    async def one(session, model):
        body = {"model": model, "prompt": "Tell me a story about", "max_tokens": 24, "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with session.post(server.url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status == 200
            text = ""
            async for line in r.content:
                if line.startswith(b"data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
            return r.headers["X-Loraplex-Frontend"], model, text

    async def main():
        results = []
        for _ in range(3):   # connections spread over the frontends by the kernel (SO_REUSEPORT)
            async with aiohttp.ClientSession() as s1, aiohttp.ClientSession() as s2:
                jobs = [one(s1 if i % 2 else s2, m) for i, m in enumerate(["r4-qv", "r16-attn", BASE] * 3)]
                results += await asyncio.gather(*jobs)
            if len({f for f, _, _ in results}) >= 2:
                break
        return results
    results = asyncio.run(main())
    assert len({f for f, _, _ in results}) >= 2, "both frontends must have served"
    by_model = {}
    for _, model, text in results:
        by_model.setdefault(model, set()).add(text)
    assert all(len(texts) == 1 for texts in by_model.values()), "same request, same greedy text"
    assert len({next(iter(t)) for t in by_model.values()}) == 3


def test_client_disconnect_frees_its_request(server):
    body = {"model": "r4-qv", "prompt": "Write a very long essay.", "max_tokens": 4000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with requests.post(server.url + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # the connection is closed: the engine must drop the request and its pages
    def idle():
        text = requests.get(server.url + "/metrics", timeout=10, headers=AUTH).text
        return metric(text, "loraplex_requests_running") == 0 and metric(text, "loraplex_pool_pages", 'kind="kv"') == 0
    assert wait_until(idle, timeout=30), requests.get(server.url + "/metrics", headers=AUTH).text[-2000:]


def test_non_streamed_request_is_aborted_when_its_client_goes_away(server):
    """aiohttp cancels the handler of a dropped connection (handler_cancellation); the handler aborts its
    engine request, which would otherwise run to max_tokens for nobody."""
    body = {"model": BASE, "prompt": "Write a very long essay.", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=3)

    def idle():
        text = requests.get(server.url + "/metrics", timeout=10, headers=AUTH).text
        return metric(text, "loraplex_requests_running") == 0 and metric(text, "loraplex_pool_pages", 'kind="kv"') == 0
    assert wait_until(idle, timeout=30), requests.get(server.url + "/metrics", headers=AUTH).text[-2000:]


@pytest.mark.parametrize("body, field", [
    ("{not json", None),
    ('{"prompt": "hi"}', "model"),
    ('{"model": "SmolLM2-135M-Instruct"}', "prompt"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": "hot"}', "temperature"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": -3}', "max_tokens"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "top_p": 7}', "top_p"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": [1, "x"]}', "prompt"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "logprobs": 50}', "logprobs"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "presence_penalty": 3}', "presence_penalty"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "echo": true, "max_tokens": -1}', "max_tokens"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "best_of": 3}', "best_of"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "tools": [{"type": "function"}]}', "tools"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "prompt_logprobs": 0}', "prompt_logprobs"),
    ('[1, 2, 3]', None),
    # hostile: not strict JSON, invalid Unicode, absurd nesting, numbers beyond int64 or the context
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": NaN}', None),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "a\\ud800b"}', None),
    (b'{"model": "SmolLM2-135M-Instruct", "prompt": "caf\xe9 latin-1, not UTF-8"}', None),
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": [1, 1180591620717411303424]}', "prompt"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "top_k": 1180591620717411303424}', "top_k"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "stop_token_ids": ["x"]}', "stop_token_ids"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "stop_token_ids": [-1]}', "stop_token_ids"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "stop_token_ids": [' + "1, " * 256 + '1]}', "stop_token_ids"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "logit_bias": {"111111111111111111111111": 1}}', "logit_bias"),
    ('{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 1000000000000}', "max_tokens"),
])
def test_malformed_bodies_get_400_and_the_server_keeps_serving(server, client, body, field):
    r = requests.post(server.url + "/v1/completions", data=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if field:
        assert err["param"] == field
    assert client.completions.create(model=BASE, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_token_ids_beyond_the_vocabulary_get_400_while_others_run(server, client):
    """Found by the fuzzer: a stop id past the vocabulary, with min_tokens, indexed the logits out of bounds
    in the step and failed every running request with a 500."""
    body = {"model": BASE, "prompt": "Count slowly:", "min_tokens": 3, "stop_token_ids": [66506715]}
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(client.completions.create, model=BASE, prompt="Tell a story:", max_tokens=24,
                            temperature=0, extra_body={"ignore_eos": True})
        r = requests.post(server.url + "/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert "stop_token_ids" in r.json()["error"]["message"]
        assert other.result().usage.completion_tokens == 24


@pytest.mark.parametrize("echo", [True, False])
def test_prompt_token_ids_beyond_the_vocabulary_get_400_naming_the_prompt(server, echo):
    """Found by the fuzzer: with echo, a prompt id of 2**57 reached the tokenizer's decode, which raised
    (ids of 2**32 and more), a 500."""
    for bad in (49152, 2 ** 57):
        body = {"model": BASE, "prompt": [1, 2, bad], "max_tokens": 2, "echo": echo}
        r = requests.post(server.url + "/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and f"token id {bad} is not in the model's vocabulary" in err["message"]


def test_logit_bias_and_penalties_as_the_openai_client_sends_them(server, client):
    tok = load_tokenizer(str(default_model_dir()))
    forced = tok(" Paris")["input_ids"][0]
    out = client.completions.create(model=BASE, prompt="The weather today", max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100}, frequency_penalty=0.5, presence_penalty=0.5)
    assert out.choices[0].text == tok.decode([forced] * 4) and out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=BASE, prompt="Hi", max_tokens=2, logit_bias={"99999999": 5})
    assert client.completions.create(model=BASE, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_echo_with_prompt_logprobs_streamed_or_not_and_prompt_only(server, client):
    """echo: the prompt first, with its tokens' logprobs (null for the first); max_tokens 0 with echo
    scores the prompt alone (how evaluation harnesses call it)."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=BASE, prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    r = client.completions.create(model=BASE, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True)
    lp, n_prompt = r.choices[0].logprobs, r.usage.prompt_tokens
    assert r.choices[0].text == prompt + plain.choices[0].text and r.usage.completion_tokens == 3
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:n_prompt]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[n_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset[n_prompt] == len(prompt)
    scored = client.completions.create(model=BASE, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    chunks = list(client.completions.create(model=BASE, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"echo": True})


def test_errors_unknown_model_long_prompt_and_api_key(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=BASE, prompt=[5] * 9000, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()
    assert requests.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="../r4-qv", prompt="Hi", max_tokens=2)


def test_every_answer_carries_the_requests_id_the_callers_own_or_a_new_one(server, client):
    """X-Request-Id as OpenAI's answers carry it (the client's `_request_id`): the caller's comes back on answers,
    streams and errors; without one each answer gets its own; one it cannot take is a 400 naming the header."""
    raw = client.completions.with_raw_response.create(model=BASE, prompt="Hi", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-7f3a/1"})
    assert raw.headers["x-request-id"] == "trace-7f3a/1" and raw.parse()._request_id == "trace-7f3a/1"
    with client.chat.completions.with_streaming_response.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
            extra_headers={"X-Request-Id": "stream-1"}) as r:
        assert r.headers["x-request-id"] == "stream-1" and list(r.iter_lines())
    ids = set()
    for path in ("/v1/models", "/health", "/metrics", "/no-such-route"):
        r = requests.get(server.url + path, headers=AUTH)
        assert r.headers["x-request-id"].startswith("req_") and len(r.headers["x-request-id"]) == 36, path
        ids.add(r.headers["x-request-id"])
    assert len(ids) == 4
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2,
                                  extra_headers={"X-Request-Id": "err-1"})
    assert e.value.request_id == "err-1"
    for bad in ("x" * 129, "two words", "caf\u00e9"):
        r = requests.post(server.url + "/v1/completions", headers={**AUTH, "X-Request-Id": bad},
                          json={"model": BASE, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"], (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_request_id" and r.headers["x-request-id"].startswith("req_")
    assert client.completions.create(model=BASE, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_tokenize_gives_the_ids_a_generation_runs_on_and_detokenize_reverses_them(server, client):
    def post(path: str, body: dict, headers: dict = AUTH) -> requests.Response:
        return requests.post(server.url + path, json=body, headers=headers)
    r = post("/tokenize", {"model": BASE, "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    got = r.json()
    done = client.completions.create(model=BASE, prompt="Once upon a time", max_tokens=1)
    assert got["count"] == len(got["tokens"]) == done.usage.prompt_tokens and got["max_model_len"] >= 2048
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post("/tokenize", {"model": "r4-qv", "messages": question}).json()      # an adapter: its base's tokenizer
    answer = client.chat.completions.create(model=BASE, messages=question, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    assert post("/detokenize", {"model": BASE, "tokens": got["tokens"]}).json() == {"prompt": "Once upon a time"}
    assert post("/tokenize", {"model": BASE, "prompt": "Hi"}, {}).status_code == 401
    refused = [(post("/tokenize", {"model": "no-such", "prompt": "Hi"}), 404, "model"),
               (post("/tokenize", {"model": BASE, "prompt": "Hi", "messages": question}), 400, "prompt"),
               (post("/tokenize", {"model": BASE}), 400, "prompt"),
               (post("/detokenize", {"model": BASE, "tokens": [1, 10 ** 9]}), 400, "tokens"),
               (post("/detokenize", {"model": BASE, "tokens": [-1]}), 400, "tokens")]
    for r, status, param in refused:
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text


def test_load_use_unload_adapter_over_http(server, client, served_adapters):
    _, src = served_adapters
    kw = dict(prompt="The weather today is", max_tokens=6, temperature=0)
    r = requests.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "extra", "lora_path": str(src / "r32-mlp")})
    assert r.status_code == 200, r.text
    assert client.completions.create(model="extra", **kw).choices[0].text        # at once, through any frontend
    # every frontend lists it once the engine's status broadcast reaches it (the other frontend may be a few
    # milliseconds behind the one that answered the load)
    assert wait_until(lambda: "extra" in {m.id for m in client.models.list().data}, timeout=5)
    r = requests.post(server.url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "extra"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", **kw)
    r = requests.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "bad", "lora_path": str(src)})      # allowed, but no adapter there
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    for outside in ("/nonexistent", "/etc", str(src / ".." / "..")):     # anywhere else on the server's disk
        r = requests.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                          json={"lora_name": "bad", "lora_path": outside})
        assert r.status_code == 400 and "--lora-roots" in r.json()["error"]["message"], r.text


def test_a_dora_adapter_over_http(server, client, served_adapters, hf_model):
    """A DoRA adapter made by PEFT, loaded through the load route and asked through the openai client (plain,
    streamed, chat) in batches with other adapters' requests; the same A and B without magnitudes (plain
    LoRA) answer otherwise: the scales are applied."""
    from tests.peft_adapters import ALL, make_adapters
    _, src = served_adapters
    if not (src / "dora-http").is_dir():
        make_adapters(hf_model, src, {"dora-http": {"r": 8, "lora_alpha": 16, "use_dora": True, "target_modules": ALL}},
                      seed=21, std=0.3)
    plain = src / "dora-http-as-lora"
    if not plain.is_dir():
        from safetensors.torch import load_file, save_file
        plain.mkdir()
        cfg = json.loads((src / "dora-http" / "adapter_config.json").read_text())
        (plain / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": False}))
        w = load_file(src / "dora-http" / "adapter_model.safetensors")
        save_file({k: v for k, v in w.items() if "magnitude" not in k}, plain / "adapter_model.safetensors")
    for name, path in (("dora-http", src / "dora-http"), ("dora-http-as-lora", plain)):
        r = requests.post(server.url + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": name,
                                                                                     "lora_path": str(path)})
        assert r.status_code == 200, r.text
    kw = dict(prompt="The weather today is", max_tokens=12, temperature=0)
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(client.completions.create, model=m, **kw) for m in ("dora-http", "r8-all", BASE)]
        dora = jobs[0].result().choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="dora-http", stream=True, **kw))
    assert dora and streamed == dora
    assert client.completions.create(model="dora-http-as-lora", **kw).choices[0].text != dora
    chat = client.chat.completions.create(model="dora-http", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].message.content
    for name in ("dora-http", "dora-http-as-lora"):
        requests.post(server.url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": name})


def test_models_show_each_adapters_content_digest(server, client, served_adapters):
    """A second name for a content already served (r8-all) shares its digest; a name listed in --adapter-dir
    and never read has none yet."""
    _, src = served_adapters
    client.completions.create(model="r8-all", prompt="Hi", max_tokens=1)
    r = requests.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "r8-all-twin", "lora_path": str(src / "r8-all")})
    assert r.status_code == 200, r.text
    def models():
        return requests.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    try:       # digests are computed in the background (at full speed while the engine is idle)
        assert wait_until(lambda: all(m.get("digest") for m in models() if m["id"] in ("r8-all", "r8-all-twin")),
                          timeout=30)
        raw = models()
        digest = {m["id"]: m.get("digest") for m in raw}
        assert digest["r8-all"].startswith("sha256:") and digest["r8-all-twin"] == digest["r8-all"]
        assert digest[BASE] is None
        listed = [m["id"] for m in raw if m["parent"] and not m.get("digest")]
        assert all(name in ("r4-qv", "r16-attn", "late") for name in listed), listed
    finally:
        requests.post(server.url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "r8-all-twin"})
    assert client.completions.create(model="r8-all", prompt="Hi", max_tokens=1).choices[0].text is not None


def test_several_adapters_on_one_request(server, client):
    """`adapters` with the base model, or with an adapter as `model` (which joins with scale 1.0): the same
    composition either way, not the adapter alone; completions and chat, streamed; bad ones refused by name."""
    kw = dict(prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=1)
    both = [{"name": "r8-all", "scale": 1.0}, {"name": "r4-qv", "scale": -2.5}]
    comp = client.completions.create(model=BASE, extra_body={"ignore_eos": True, "adapters": both}, **kw).choices[0]
    via = client.completions.create(model="r8-all", extra_body={"ignore_eos": True, "adapters": both[1:]}, **kw)
    alone = client.completions.create(model="r8-all", extra_body={"ignore_eos": True}, **kw).choices[0]
    assert via.choices[0].logprobs.token_logprobs == comp.logprobs.token_logprobs
    assert alone.logprobs.token_logprobs != comp.logprobs.token_logprobs
    chunks = list(client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Say hi"}],
                                                 max_tokens=4, stream=True, extra_body={"adapters": both}))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    five = [{"name": n} for n in ("r8-all", "r4-qv", "r16-attn", "late", "other")]
    for adapters, status, text in (([{"name": "r4-qv", "scale": 11}], 400, "adapters"),
                                   (five, 400, "at most 4"),
                                   ([{"name": "nope"}], 404, "nope"),
                                   ([{"name": BASE}], 404, BASE)):
        r = requests.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": BASE, "prompt": "Hi", "max_tokens": 1, "adapters": adapters})
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
    assert client.completions.create(model=BASE, prompt="Hi", max_tokens=1).choices[0].text is not None


def test_adapter_on_demand_from_adapter_dir(server, client, served_adapters):
    d, src = served_adapters
    shutil.copytree(src / "r64-ko", d / "late")
    out = client.completions.create(model="late", prompt="Hello", max_tokens=4, temperature=0)
    assert out.choices[0].text is not None
    assert "late" in {m.id for m in client.models.list().data}


def test_health_and_metrics_show_engine_figures_from_any_frontend(server):
    assert requests.get(server.url + "/health").json() == {"status": "ok"}
    with ThreadPoolExecutor(4) as ex:
        texts = list(ex.map(lambda _: requests.get(server.url + "/metrics", headers=AUTH).text, range(6)))
    for text in texts:
        assert metric(text, "loraplex_pool_pages", 'kind="free"') > 0
        assert "loraplex_time_to_first_token_seconds_bucket" in text
        assert metric(text, "loraplex_adapter_loads_total") >= 1
        assert 'loraplex_requests_total{adapter="r8-all"' in text


def test_kill_9_of_a_frontend_frees_its_requests_and_it_is_restarted(server):
    import os
    import signal
    import subprocess
    body = {"model": "r4-qv", "prompt": "An endless story:", "max_tokens": 4000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with requests.post(server.url + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=60) as r:
        frontend = r.headers["X-Loraplex-Frontend"]
        lines = r.iter_lines()
        next(lines)
        pattern = f"--engine-address {server.engine_address} .*--frontend-id {frontend}( |$)"   # this server's only
        pid = int(subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)

    def recovered():
        try:
            text = requests.get(server.url + "/metrics", timeout=5, headers=AUTH).text
        except requests.RequestException:
            return False
        return metric(text, "loraplex_requests_running") == 0 and metric(text, "loraplex_pool_pages", 'kind="kv"') == 0
    assert wait_until(recovered, timeout=60)
    assert wait_until(lambda: "restarting" in "".join(server.lines), timeout=30)
    assert wait_until(lambda: len({requests.get(server.url + "/health").headers["X-Loraplex-Frontend"]
                                   for _ in range(20)}) == 2, timeout=60)


def test_a_request_made_while_the_engine_is_unavailable_waits_for_it(server, client):
    """/health says 503 while the engine does not answer; a completion asked for then is held (not
    failed) and answered once the engine is back; an invalid one is refused at once."""
    import os
    import signal
    import threading
    pid = server.engine_pid
    os.kill(pid, signal.SIGSTOP)
    result: dict = {}
    try:
        assert wait_until(lambda: requests.get(server.url + "/health").status_code == 503, timeout=20)
        t = threading.Thread(target=lambda: result.update(r=requests.post(
            server.url + "/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2}, headers=AUTH,
            timeout=120)))
        t.start()
        bad = requests.post(server.url + "/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 0},
                            headers=AUTH, timeout=10)           # a bad request is not held: 400 at once
        assert bad.status_code == 400 and "max_tokens" in bad.text
        time.sleep(2)
        assert t.is_alive() and not result
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(120)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["completion_tokens"] == 2
    assert wait_until(lambda: requests.get(server.url + "/health").status_code == 200, timeout=20)


def test_kill_9_of_the_engine_loses_no_in_flight_request(server, client, served_adapters):
    """Runs last in this module: the engine comes back with the --adapter-dir adapters and those loaded
    over HTTP (its journal), and the stream that was running when it died, on an adapter loaded over
    HTTP, carries on to its full length (resent as prompt + tokens so far), with the seeded tokens an
    uninterrupted run gives."""
    import os
    import signal
    _, src = served_adapters
    body = {"lora_name": "tenant-x", "lora_path": str(src / "r8-all")}
    r = requests.post(server.url + "/v1/load_lora_adapter", json=body,
                      headers=AUTH)
    assert r.status_code == 200, r.text
    pid = server.engine_pid
    n = 40
    body = {"model": "tenant-x", "prompt": "An endless story:", "max_tokens": n, "temperature": 1.0, "seed": 1234,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with requests.post(server.url + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=300) as r:
        lines = r.iter_lines()
        first = next(lines)
        os.kill(pid, signal.SIGKILL)
        rest = [first] + [l for l in lines if l]
    assert not any(b'"error"' in l for l in rest), rest[-3:]
    events = [json.loads(l[len(b"data: "):]) for l in rest if l.startswith(b"data: {")]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == n and usage["prompt_tokens"] < 10, usage
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text
    assert "engine restarted" in "".join(server.lines)
    assert wait_until(lambda: requests.get(server.url + "/health").status_code == 200, timeout=30)
    whole = requests.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=300)
    assert whole.json()["choices"][0]["text"] == text
    assert "tenant-x" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="tenant-x", prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_kill_9_of_the_engine_mid_constrained_stream_gives_the_same_json(server, client):
    """After the test above (the engine it restarted is found by its command line): a stream under a JSON
    schema, the engine SIGKILLed after a few chunks; the resent request compiles its constraint in the new
    engine, replays the tokens so far through it, and ends with the JSON an uninterrupted call gives."""
    import os
    import signal
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                              text=True).stdout.splitlines()
    pid = next(int(c.split()[0]) for c in children if "engine.serving.engine_proc" in c)
    restarts = "".join(server.lines).count("engine restarted")
    schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 8,
                                                         "items": {"type": "string", "maxLength": 30}}},
              "required": ["items"], "additionalProperties": False}
    kw = dict(model=BASE, messages=[{"role": "user", "content": "List six fruits as JSON."}], max_tokens=150,
              temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    text, chunks = "", 0
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].delta.content:
            text, chunks = text + ch.choices[0].delta.content, chunks + 1
            if chunks == 6:
                os.kill(pid, signal.SIGKILL)
    assert chunks > 6 and len(json.loads(text)["items"]) >= 6
    assert "".join(server.lines).count("engine restarted") == restarts + 1
    assert client.chat.completions.create(**kw).choices[0].message.content == text


def test_frontends_tokenize_without_torch(server):
    """A frontend only tokenizes: its process never maps torch (engine/tokenizer.py tokenizer_only)."""
    children = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                              text=True).stdout.splitlines()
    fronts = [int(line.split()[0]) for line in children if "frontends.http_server" in line]
    engines = [int(line.split()[0]) for line in children if "engine.serving.engine_proc" in line]
    assert len(fronts) == 2 and len(engines) == 1, children     # (restarted ones too: tests above kill some)
    for pid in fronts:
        maps = open(f"/proc/{pid}/maps").read()
        assert "tokenizers" in maps and "libtorch" not in maps, pid
    assert "libtorch" in open(f"/proc/{engines[0]}/maps").read()      # the check sees torch where it is


def test_structured_outputs_as_openai_and_vllm_clients_ask_for_them(server, client):
    """response_format json_schema / json_object (OpenAI), structured_outputs and guided_choice (vLLM), on
    chat and completions, streamed or not; a constraint the engine cannot compile, or two of them, is a 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
    out = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=48, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    city = json.loads(out.choices[0].message.content)
    assert set(city) == {"city", "population"} and isinstance(city["population"], int)
    streamed = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=48, temperature=0, stream=True,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), dict)
    pick = client.completions.create(model="r8-all", prompt="The weather is", max_tokens=8, n=3, temperature=1.0,
                                     seed=3, extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert all(c.text in ("sunny", "rainy", "cloudy") for c in pick.choices)
    code = client.completions.create(model=BASE, prompt="Code:", max_tokens=8,
                                     extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", code.choices[0].text)
    with pytest.raises(openai.BadRequestError, match=r"'guided_regex': .*parenthesis") as e:
        client.completions.create(model=BASE, prompt="x", max_tokens=2, extra_body={"guided_regex": "(ab"})
    assert e.value.body["param"] == "guided_regex"          # the field the client sent
    with pytest.raises(openai.BadRequestError, match="give one constraint on the output, not 2") as e:
        client.completions.create(model=BASE, prompt="x", max_tokens=2,
                                  extra_body={"response_format": {"type": "json_object"}, "guided_choice": ["a"]})
    assert e.value.body["param"] == "guided_choice"
    with pytest.raises(openai.BadRequestError, match="json_schema.schema") as e:
        client.chat.completions.create(model=BASE, messages=msgs, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    plain = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=4, temperature=0,
                                           response_format={"type": "text"})
    assert plain.choices[0].message.content
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert metric(text, "loraplex_grammar_compiles_total", 'outcome="ok"') >= 4
    assert metric(text, "loraplex_grammar_compiles_total", 'outcome="error"') >= 1
    assert metric(text, "loraplex_grammar_compile_seconds_count") >= 5


def test_a_continued_last_turn_and_template_variables(client):
    """vLLM's continue_final_message (the assistant's last turn goes on) and chat_template_kwargs (more
    variables for the template; the ones the server sets itself are refused by name)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    out = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=4, temperature=0,
                                         extra_body={"continue_final_message": True})
    assert out.choices[0].message.content.strip().startswith("Paris")
    plain = client.chat.completions.create(model=BASE, messages=msgs[:1], max_tokens=4, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.usage.prompt_tokens < out.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="may not set tools") as e:
        client.chat.completions.create(model=BASE, messages=msgs[:1], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs"
