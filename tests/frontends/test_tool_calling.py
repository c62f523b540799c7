"""Tool calling through the real server and the official openai client: a tiny random Llama served with
configs/tool_chat_template_hermes.jinja and --tool-call-parser hermes. Its output is noise, so the named
and required calls show the constraints (every call parses and follows its schema), and "auto" is shown
on text forced into the Hermes format by a regex."""
from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import openai
import pytest
import requests

from engine.tokenizer import encode_chat, load_tokenizer
from frontends.api_requests import ChatCompletionRequest
from frontends.chat_endpoint import template_messages
from tests.frontends.server_fixture import Server

TEMPLATE = Path(__file__).parents[2] / "configs" / "tool_chat_template_hermes.jinja"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def tool_server(tiny_served):
    model, _ = tiny_served
    s = Server("--model", str(model), "--frontends", "1", "--chat-template", str(TEMPLATE),
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s, model
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server[0].url + "/v1", api_key="unused")


def call(client, **kw):
    return client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, max_tokens=120, **kw)


def streamed(client, **kw) -> tuple[str, dict, str | None]:
    """A streamed answer put together as a client does: content, tool calls by index, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in call(client, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            c["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit") and len(args["city"]) <= 12
    return name == "get_time" and set(args) == {"city"} and len(args["city"]) <= 12


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = call(client, tool_choice=named, n=3, temperature=1.0, seed=5)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        [tc] = choice.message.tool_calls
        assert tc.type == "function" and tc.id.startswith("call_") and valid(tc.function.name, tc.function.arguments)
    greedy = call(client, tool_choice=named, temperature=0).choices[0].message.tool_calls[0]
    content, calls, finish = streamed(client, tool_choice=named, temperature=0)
    assert content == "" and finish == "stop" and list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], calls[0]["arguments"]) == (greedy.function.name, greedy.function.arguments)


def test_required_makes_one_call_or_more_of_the_tools(client):
    for parallel in (True, False):
        out = call(client, tool_choice="required", parallel_tool_calls=parallel, temperature=1.0, seed=11, n=2)
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert choice.message.tool_calls and all(valid(t.function.name, t.function.arguments)
                                                     for t in choice.message.tool_calls)
            assert parallel or len(choice.message.tool_calls) == 1
    whole = call(client, tool_choice="required", temperature=0).choices[0].message.tool_calls
    content, calls, finish = streamed(client, tool_choice="required", temperature=0)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(t.function.name, t.function.arguments)
                                                                     for t in whole]


def test_auto_separates_text_and_hermes_calls_whole_and_streamed(client):
    """The model's text forced (a regex) into what a Hermes-trained model writes: text, then a call."""
    target = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    regex = re.sub(r"([.\\^$*+?()\[\]{}|])", r"\\\1", target)
    kw = dict(temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    out = call(client, **kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in out.message.tool_calls] == [
        ("get_time", {"city": "Oslo"})]
    content, calls, finish = streamed(client, logprobs=True, **kw)
    assert content == "Let me check.\n" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"city": "Oslo"})]
    none = call(client, tool_choice="none", **kw).choices[0]
    assert none.message.content == target and none.message.tool_calls is None and none.finish_reason == "stop"


def test_the_conversation_goes_on_after_a_call_and_tokenize_shows_its_prompt(tool_server, client):
    server, model = tool_server
    made = call(client, tool_choice="required", temperature=0).choices[0].message
    history = ASK + [made.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": made.tool_calls[0].id, "content": '{"temp": 12}'}]
    again = client.chat.completions.create(model="model", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")
    got = requests.post(server.url + "/tokenize", json={"model": "model", "messages": history, "tools": TOOLS},
                        timeout=30).json()
    tok = load_tokenizer(str(model))
    req = msgspec.json.decode(json.dumps({"model": "model", "messages": history}), type=ChatCompletionRequest)
    want = encode_chat(tok, template_messages(req.messages), TOOLS, TEMPLATE.read_text())
    assert got["tokens"] == want
    text = tok.decode(want)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_response>" in text
    assert made.tool_calls[0].function.name in text.split("<tool_call>")[-1]     # the call, rendered


@pytest.mark.parametrize("kw, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not define"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "give one constraint on the output, not 2"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools"),
    ({"messages": [{"role": "user"}]}, "messages", "missing required field `content`"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages", "has no content"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "'tools': Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
      "tools": None}, "response_format", "'response_format': Unsupported type"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(client, kw, param, says):
    body = {"messages": ASK, "tools": TOOLS, **kw}
    with pytest.raises(openai.BadRequestError, match=says) as e:
        client.chat.completions.create(model="model", max_tokens=4, **body)
    assert e.value.body["param"] == param


def test_completions_refuse_tools(client):
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        client.completions.create(model="model", prompt="x", max_tokens=2, extra_body={"tools": TOOLS})
