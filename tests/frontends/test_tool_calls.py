"""Tool calling's parts without a server: the plan a request makes (frontends/tool_calls.py), the parsers
of `tool_choice` "auto" (frontends/tool_parsers.py), a choice shown whole and streamed, the conversation as
templates take it, and the serve flags."""
from __future__ import annotations

import argparse
import json

import msgspec
import pytest

from frontends.api_error import ApiError
from frontends.api_requests import ChatCompletionRequest
from frontends.chat_endpoint import template_messages
from frontends.cli import chat_argv
from frontends.tool_calls import ToolView, tool_plan
from frontends.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, PythonicParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def req(**kw) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def view(plan) -> ToolView:
    return ToolView(plan, None, None)


def test_each_tool_choice_makes_its_plan():
    named = tool_plan(req(tool_choice={"type": "function", "function": {"name": "get_weather"}}), None)
    assert named.mode == "named" and named.constraint.json == WEATHER
    assert named.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}   # none given: no arguments
    required = tool_plan(req(tool_choice="required", parallel_tool_calls=False), None)
    schema = required.constraint.json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert "maxItems" not in tool_plan(req(tool_choice="required"), None).constraint.json
    assert tool_plan(req(tool_choice="none"), None).constraint is None
    assert tool_plan(req(), "hermes").mode == "auto"                       # the default with tools
    assert tool_plan(req(tools=None), None) is None and tool_plan(req(tools=None, tool_choice="none"), None) is None


@pytest.mark.parametrize("kw, says", [
    ({}, "needs a server started with --tool-call-parser"),
    ({"tool_choice": "auto"}, "needs a server started with --tool-call-parser"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which 'tools' does not define"),
    ({"tools": None, "tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": TOOLS + TOOLS[:1]}, "'get_weather' is defined twice"),
])
def test_a_tool_choice_that_cannot_be_honoured_is_a_400_naming_it(kw, says):
    with pytest.raises(ApiError) as e:
        tool_plan(req(**kw), None)
    assert e.value.status == 400 and says in e.value.message and e.value.param in ("tool_choice", "tools")


def test_function_names_are_checked_when_decoded():
    bad = {"type": "function", "function": {"name": "has space"}}
    with pytest.raises(msgspec.ValidationError, match="tools"):
        req(tools=[bad])


def test_a_named_call_whole_and_streamed():
    plan = tool_plan(req(tool_choice={"type": "function", "function": {"name": "get_weather"}}), None)
    message, finish = view(plan).message('{"city": "Oslo"}', "stop")
    assert finish == "stop" and message.content is None
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert calls == [("get_weather", '{"city": "Oslo"}')]
    assert message.tool_calls[0].id.startswith("call_")
    cut, finish = view(plan).message('{"city": "Os', "length")         # max_tokens cut it: shown as text
    assert cut.content == '{"city": "Os' and cut.tool_calls is None and finish == "length"
    v = view(plan)
    first, _ = v.delta('{"ci', None, True)
    later, _ = v.delta('ty": "Oslo"}', None, False)
    last, finish = v.delta("", "stop", False)
    assert first.role == "assistant" and first.tool_calls[0].id and first.tool_calls[0].function.name == "get_weather"
    assert later.tool_calls[0].id is None and later.tool_calls[0].function.name is None
    assert first.tool_calls[0].function.arguments + later.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    assert last.tool_calls is None and finish == "stop"


def test_required_calls_whole_and_streamed():
    plan = tool_plan(req(tool_choice="required"), None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    message, finish = view(plan).message(text, "stop")
    assert finish == "tool_calls" and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    v = view(plan)
    held, finish = v.delta(text[:20], None, True)
    assert held.role == "assistant" and held.tool_calls is None and held.content is None and finish is None
    done, finish = v.delta(text[20:], "stop", False)
    assert finish == "tool_calls" and [c.index for c in done.tool_calls] == [0, 1]
    assert [c.function.name for c in done.tool_calls] == ["get_weather", "get_time"]
    cut, finish = view(plan).delta(text[:30], "length", True)
    assert cut.content == text[:30] and finish == "length"


def test_auto_with_hermes_separates_text_and_calls_however_the_text_is_split():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message, finish = view(tool_plan(req(), "hermes")).message(text, "stop")
    assert finish == "tool_calls" and message.content == "Let me look."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    for step in (1, 3, 7, len(text)):
        v, content, calls, finish = view(tool_plan(req(), "hermes")), "", [], None
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for k, piece in enumerate(pieces):
            delta, finish = v.delta(piece, "stop" if k == len(pieces) - 1 else None, k == 0)
            content += delta.content or ""
            calls += delta.tool_calls or []
            assert "<" not in (delta.content or "")         # a tag's first characters are held back
        assert content == "Let me look.\n" and finish == "tool_calls", step
        assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (0, "get_weather", {"city": "Oslo"}), (1, "get_time", {})], step


def test_auto_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    plan = tool_plan(req(parallel_tool_calls=False), "hermes")
    message, _ = view(plan).message(text, "stop")
    assert [c.function.name for c in message.tool_calls] == ["a"]
    v, names = view(plan), []
    for k, piece in enumerate([text[:40], text[40:80], text[80:]]):
        delta, _ = v.delta(piece, "stop" if k == 2 else None, k == 0)
        names += [c.function.name for c in delta.tool_calls or []]
    assert names == ["a"]


def test_auto_text_without_calls_stays_text_and_a_broken_block_comes_back_unchanged():
    plain, finish = view(tool_plan(req(), "hermes")).message("It is 3 < 4.", "stop")
    assert plain.content == "It is 3 < 4." and plain.tool_calls is None and finish == "stop"
    parser = HermesParser()
    content, calls = parser.feed("a <tool_call>not json</tool_call> b <tool_")
    rest, more = parser.end()
    assert content + rest == "a <tool_call>not json</tool_call> b <tool_" and calls == more == []
    parser = HermesParser()                       # a model that stops before the closing tag
    assert parser.feed('<tool_call>{"name": "f", "arguments": {"x": 1}}') == ("", [])
    assert parser.end() == ("", [("f", '{"x": 1}')])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_llama3_json_after_its_python_tag_however_split(step):
    assert feed_all(Llama3JsonParser(), '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', step) == (
        "", [("f", '{"a": 1}')])
    assert feed_all(Llama3JsonParser(), "<b>bold</b>", step) == ("<b>bold</b>", [])


def test_llama3_json_calls_and_text():
    parser = Llama3JsonParser()
    assert parser.feed(' {"name": "get_time", "parameters": {"ci') == ("", [])
    assert parser.feed('ty": "Oslo"}}; {"name": "get_weather", "parameters": {}}') == ("", [])
    assert parser.end() == ("", [("get_time", '{"city": "Oslo"}'), ("get_weather", "{}")])
    parser = Llama3JsonParser()
    assert parser.feed("Hello") == ("Hello", []) and parser.feed(" {x}") == (" {x}", []) and parser.end() == ("", [])
    parser = Llama3JsonParser()
    parser.feed('{"not": "a call"}')
    assert parser.end() == ('{"not": "a call"}', [])


def feed_all(parser, text: str, step: int) -> tuple[str, list]:
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = parser.feed(text[i:i + step])
        content, calls = content + c, calls + k
    c, k = parser.end()
    return content + c, calls + k


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_mistral_calls_after_the_mark_or_as_a_bare_array(step):
    array = '[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "f", "arguments": {}}]'
    want = [("get_time", '{"city": "Oslo"}'), ("f", "{}")]
    assert feed_all(MistralParser(), "Sure. [TOOL_CALLS]" + array, step) == ("Sure. ", want)
    assert feed_all(MistralParser(), " " + array, step) == ("", want)          # the control token dropped
    assert feed_all(MistralParser(), "[TOOL_CALLS]" + array, step) == ("", want)
    assert feed_all(MistralParser(), "Lists look like [1, 2].", step) == ("Lists look like [1, 2].", [])
    assert feed_all(MistralParser(), "[not json", step) == ("[not json", [])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_pythonic_calls_are_parsed_never_run(step):
    text = '[get_weather(city="Oslo", days=2), get_time()]'
    assert feed_all(PythonicParser(), text, step) == ("", [("get_weather", '{"city": "Oslo", "days": 2}'),
                                                          ("get_time", "{}")])
    assert feed_all(PythonicParser(), "<|python_start|>[f(x=[1, 2])]<|python_end|>", step) == ("", [
        ("f", '{"x": [1, 2]}')])
    for text in ("[__import__('os').system('true')]", "[f(x=open('/etc/passwd'))]", "[f(1)]", "[1, 2]",
                 "Hello [f()]"):
        assert feed_all(PythonicParser(), text, step) == (text, []), text


def test_the_conversation_reaches_the_template_with_calls_as_objects():
    body = req(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "12 C"}])
    assert template_messages(body.messages) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1", "name": "get_weather"}]
    with pytest.raises(ApiError, match=r"messages\[0\] has no content"):
        template_messages(req(messages=[{"role": "assistant", "content": None}]).messages)
    with pytest.raises(msgspec.ValidationError, match="missing required field `content`"):
        req(messages=[{"role": "user"}])
    with pytest.raises(msgspec.ValidationError, match="missing required field `tool_call_id`"):
        req(messages=[{"role": "tool", "content": "12 C"}])


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"enable_auto_tool_choice": False, "tool_call_parser": None, "chat_template": None,
                                 **kw})


def test_serve_flags_for_chat(tmp_path):
    assert chat_argv(_args()) == []
    assert chat_argv(_args(enable_auto_tool_choice=True, tool_call_parser="hermes")) == ["--tool-call-parser", "hermes"]
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        chat_argv(_args(enable_auto_tool_choice=True))
    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    bad.write_text("line one\n{% for m in messages %}")
    assert chat_argv(_args(chat_template=str(good))) == ["--chat-template", str(good)]
    with pytest.raises(ValueError, match="bad.jinja line 2"):
        chat_argv(_args(chat_template=str(bad)))
    with pytest.raises(ValueError, match="cannot read"):
        chat_argv(_args(chat_template=str(tmp_path / "missing.jinja")))
