"""Chunks of a streamed answer, built by the two endpoints: the role and echoed prompt on each choice's
first chunk only, text offsets of logprobs carried across chunks, usage summed over the choices; and the
structs encode to OpenAI's JSON."""
from __future__ import annotations

import json

import msgspec

from frontends.api_requests import ChatCompletionRequest, CompletionRequest, UserMessage
from frontends.api_responses import Usage
from frontends.chat_endpoint import ChatEndpoint
from frontends.completions_endpoint import CompletionsEndpoint
from frontends.stream_chunks import StreamChunks, finish_reason
from ipc.outputs import RequestOutput, TokenLogprobs

PIECES = {1: "He", 2: "llo", 3: "!"}


class Tokens:
    def decode(self, ids):
        return "".join(PIECES[i] for i in ids)


def endpoint(kind):
    return kind(client=None, tokenizer=Tokens(), labels=None, stream_timeout=1.0)


def as_json(struct) -> dict:
    return json.loads(msgspec.json.encode(struct))


def request(kind):
    if kind is ChatEndpoint:
        return ChatCompletionRequest(model="m", messages=[UserMessage(content="Hi")])
    return CompletionRequest(model="m", prompt="Hi")


def stream(kind, n=1, echo=None, prompt_only=False):
    e = endpoint(kind)
    return StreamChunks("id", "m", e, [e.view(request(kind), [1], echo, prompt_only) for _ in range(n)], n)


def out(text, ids=(), finish=None, completion=1, cached=0):
    return RequestOutput("r", text=text, finish_reason=finish, prompt_tokens=4, completion_tokens=completion,
                         cached_tokens=cached, logprobs=[TokenLogprobs(i, -0.5) for i in ids])


def test_first_chat_chunk_carries_the_role_and_later_ones_do_not():
    c = stream(ChatEndpoint, n=2)
    first, second = as_json(c.chunk(0, out("He", (1,)))), as_json(c.chunk(0, out("llo", (2,))))
    assert first["object"] == "chat.completion.chunk" and "usage" not in first
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert second["choices"][0]["delta"] == {"content": "llo"}
    assert second["choices"][0]["logprobs"] == {"content": [{"token": "llo", "logprob": -0.5,
                                                             "bytes": list(b"llo"), "top_logprobs": []}]}
    assert as_json(c.chunk(1, out("!")))["choices"][0] == {"index": 1, "delta": {"role": "assistant",
                                                           "content": "!"}, "finish_reason": None, "logprobs": None}


def test_completion_logprobs_carry_text_offsets_across_chunks():
    c = stream(CompletionsEndpoint)
    c.chunk(0, out("He", (1,)))
    lps = as_json(c.chunk(0, out("llo", (2,))))["choices"][0]["logprobs"]
    assert lps == {"tokens": ["llo"], "token_logprobs": [-0.5], "top_logprobs": [{}], "text_offset": [2]}


def test_an_empty_output_after_the_first_sends_nothing():
    c = stream(CompletionsEndpoint)
    assert c.chunk(0, out("")) is not None          # the first chunk always goes out
    assert c.chunk(0, out("")) is None
    assert c.chunk(0, out("", finish="abort")).choices[0].finish_reason == "stop"


def test_echo_puts_the_prompt_before_the_first_chunk_and_shifts_offsets():
    c = stream(CompletionsEndpoint, echo="Say: ")
    first = as_json(c.chunk(0, out("He", (1,))))
    assert first["choices"][0]["text"] == "Say: He"
    lps = first["choices"][0]["logprobs"]
    assert lps["tokens"] == ["He", "He"] and lps["token_logprobs"] == [None, -0.5]   # the prompt's token first
    assert lps["top_logprobs"][0] is None
    assert c.chunk(0, out("llo", (2,))).choices[0].logprobs.text_offset == [len("Say: He")]


def test_usage_sums_completions_over_the_choices_once_all_finished():
    c = stream(ChatEndpoint, n=2)
    assert not c.finish(0, out("a", finish="stop", completion=3))
    assert c.finish(1, out("b", finish="length", completion=5, cached=2))
    last = as_json(c.usage())
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"


def test_a_whole_answer_sends_null_logprobs_and_omits_what_is_unset():
    use = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    body = as_json(endpoint(CompletionsEndpoint).answer("id", "m", [("hi", "stop", None, None)], use))
    assert body["choices"] == [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}]
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def test_finish_reason_maps_abort_to_stop():
    assert [finish_reason(r) for r in ("abort", "length", None)] == ["stop", "length", None]
