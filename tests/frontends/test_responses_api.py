"""POST /v1/responses (OpenAI's Responses API, stateless): the request as a chat request, the events a
stream is made of, and the real server (the default model) through the official openai client: text,
instructions, a cut answer, a JSON schema, function calls and the tool loop, streamed or not."""
from __future__ import annotations

import json

import msgspec
import openai
import pytest

from frontends.api_error import ApiError
from frontends.api_requests import ChatCompletionRequest
from frontends.api_responses import Usage
from frontends.responses_api import ResponsesRequest, to_chat
from frontends.responses_endpoint import ResponsesView
from frontends.tool_calls import ToolView, tool_plan
from tests.frontends.conftest import API_KEY

BASE = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather now", "parameters": WEATHER}]


def req(**kw) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": "hi", **kw}, ResponsesRequest)


def test_the_input_becomes_the_conversation():
    body = to_chat(req(instructions="Be brief.", max_output_tokens=9, tools=TOOLS, tool_choice={
        "type": "function", "name": "get_weather"}, text={"format": {"type": "json_object"}}, input=[
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12 C"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And "},
                                                         {"type": "input_text", "text": "now?"}]}]))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"}, {"role": "user", "content": "And now?"}]
    assert body["max_completion_tokens"] == 9 and body["response_format"] == {"type": "json_object"}
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "the weather now",
                                                                "parameters": WEATHER}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("kw, param", [({"previous_response_id": "resp_1"}, "previous_response_id"),
                                       ({"store": True}, "store"),
                                       ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
                                       ({"text": {"format": {"type": "json_schema"}}}, "text")])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_the_field(kw, param):
    with pytest.raises(ApiError) as e:
        to_chat(req(**kw))
    assert e.value.status == 400 and e.value.param == param


def test_a_streamed_answer_is_items_added_filled_and_done_in_sequence():
    view = ResponsesView(req(), None, None, None)
    events = view.events("resp_1", "m", "Hel", None, True) + view.events("resp_1", "m", "lo", "stop", False)
    events.append(view.final(Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)))
    kinds = [type(e).__struct_config__.tag for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[2].item.content == [] and events[2].item.status == "in_progress"     # as it was when added
    done = events[-1].response
    assert done.status == "completed" and done.output[0].content[0].text == "Hello" and done.usage.total_tokens == 5


def test_a_streamed_call_is_its_own_item():
    """tool_choice naming a function: the arguments stream in as they are generated."""
    origin = req(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    plan = tool_plan(msgspec.convert(to_chat(origin), ChatCompletionRequest), None)
    view = ResponsesView(origin, ToolView(plan, None, None), None, None)
    events = view.events("resp_1", "m", '{"city"', None, True) + view.events("resp_1", "m", ': "Oslo"}', "stop", False)
    kinds = [type(e).__struct_config__.tag for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"]
    assert events[-2].arguments == '{"city": "Oslo"}' and events[-1].item.name == "get_weather"
    assert events[2].item.arguments == "" and events[-1].item.call_id.startswith("call_")
    final = view.final(Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)).response
    assert [type(i).__name__ for i in final.output] == ["FunctionCallItem"]
    assert final.tool_choice == {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def test_text_whole_and_streamed_with_the_openai_client(client):
    out = client.responses.create(model=BASE, input="What is the capital of France?", max_output_tokens=16,
                                  temperature=0)
    assert out.status == "completed" and "Paris" in out.output_text and out.output[0].type == "message"
    assert out.id.startswith("resp_") and out.usage.input_tokens > 0 and out.usage.output_tokens > 0
    stream = client.responses.create(model=BASE, input="What is the capital of France?", max_output_tokens=16,
                                     temperature=0, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    cut = client.responses.create(model=BASE, input="Tell me a long story.", max_output_tokens=5, temperature=0,
                                  instructions="You are a storyteller.")
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5 and cut.instructions == "You are a storyteller."


def test_a_json_schema_and_a_tool_loop(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": schema}}
    out = client.responses.create(model=BASE, input="The capital of France, as JSON.", max_output_tokens=30,
                                  temperature=0, text=fmt)
    assert set(json.loads(out.output_text)) == {"capital"}
    asked = client.responses.create(model=BASE, input="What is the weather in Oslo?", tools=TOOLS,
                                    tool_choice="required", max_output_tokens=40, temperature=0)
    [call] = asked.output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    streamed = list(client.responses.create(model=BASE, input="What is the weather in Oslo?", tools=TOOLS,
                                            tool_choice="required", max_output_tokens=40, temperature=0, stream=True))
    done = streamed[-1].response.output[0]
    assert (done.name, done.arguments) == (call.name, call.arguments)
    assert "response.function_call_arguments.done" in [e.type for e in streamed]
    answer = client.responses.create(model=BASE, max_output_tokens=12, temperature=0, tools=TOOLS, tool_choice="none",
                                     input=[{"role": "user", "content": "What is the weather in Oslo?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temperature": 12}'}])
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=BASE, input="x", previous_response_id=out.id)
    with pytest.raises(openai.BadRequestError, match="'max_output_tokens' is 100000") as e:
        client.responses.create(model=BASE, input="x", max_output_tokens=100000)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError, match="'text': Unsupported type") as e:
        client.responses.create(model=BASE, input="x", text={"format": {"type": "json_schema", "name": "x",
                                                                        "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "text"
