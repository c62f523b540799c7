"""Chunks of a streamed answer: the role and echoed prompt on each choice's first chunk only, text offsets
of logprobs carried across chunks, usage summed over the choices."""
from __future__ import annotations

from frontends import openai_protocol as oai
from frontends.echo import Echo
from frontends.stream_chunks import StreamChunks, finish_reason
from ipc.outputs import RequestOutput, TokenLogprobs

PIECES = {1: "He", 2: "llo", 3: "!"}


def view(prompt=None, prompt_only=False):
    fmt = lambda entries, offset: oai.completion_logprobs(entries, PIECES.__getitem__, offset)  # noqa: E731
    return Echo(prompt, [1], prompt_only, fmt, PIECES.__getitem__)


def out(text, ids=(), finish=None, completion=1):
    return RequestOutput("r", text=text, finish_reason=finish, prompt_tokens=4, completion_tokens=completion,
                         logprobs=[TokenLogprobs(i, -0.5) for i in ids])


def test_first_chat_chunk_carries_the_role_and_later_ones_do_not():
    c = StreamChunks(2, "id", "m", chat=True, view=view())
    first, second = c.chunk(0, out("He", (1,))), c.chunk(0, out("llo", (2,)))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert second["choices"][0]["delta"] == {"content": "llo"}
    lps = second["choices"][0]["logprobs"]
    assert lps["tokens"] == ["llo"] and lps["text_offset"] == [2]
    assert c.chunk(1, out("!"))["choices"][0]["index"] == 1


def test_an_empty_output_after_the_first_sends_nothing():
    c = StreamChunks(1, "id", "m", chat=False, view=view())
    assert c.chunk(0, out("")) is not None          # the first chunk always goes out
    assert c.chunk(0, out("")) is None
    assert c.chunk(0, out("", finish="abort"))["choices"][0]["finish_reason"] == "stop"


def test_echo_puts_the_prompt_before_the_first_chunk_and_shifts_offsets():
    c = StreamChunks(1, "id", "m", chat=False, view=view(prompt="Say: "))
    first = c.chunk(0, out("He", (1,)))
    assert first["choices"][0]["text"] == "Say: He"
    assert first["choices"][0]["logprobs"]["tokens"] == ["He", "He"]        # the prompt's token, then "He"
    assert c.chunk(0, out("llo", (2,)))["choices"][0]["logprobs"]["text_offset"] == [len("Say: He")]


def test_usage_sums_completions_over_the_choices_once_all_finished():
    c = StreamChunks(2, "id", "m", chat=True, view=view())
    assert not c.finish(0, out("a", finish="stop", completion=3))
    assert c.finish(1, out("b", finish="length", completion=5))
    assert c.usage()["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    assert c.usage()["choices"] == [] and c.usage()["object"] == "chat.completion.chunk"


def test_finish_reason_maps_abort_to_stop():
    assert [finish_reason(r) for r in ("abort", "length", None)] == ["stop", "length", None]
