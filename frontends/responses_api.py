"""OpenAI's Responses API (`POST /v1/responses`), stateless: its typed request, its answer and stream events,
and the request as the chat route's (`to_chat`), which does the work (tools, structured output, sampling).

Stateless: the server keeps no responses, so `previous_response_id`, and `store` true, are refused by name;
a client sends the conversation in `input` (messages, and its `function_call` / `function_call_output`
items), as with `store` false at OpenAI. `instructions` become the first system turn.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from frontends.api_error import ApiError
from frontends.api_requests import ChatCompletionRequest, FunctionName
from frontends.api_responses import _Shape


# -- the request ------------------------------------------------------------------------------------------
class ContentPart(msgspec.Struct, kw_only=True):
    """A part of a message's content: `input_text` (or `output_text`, an earlier answer's)."""
    type: Literal["input_text", "output_text"]
    text: str


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`: a message (`type` "message" or left out: `role` and `content`), an earlier
    `function_call` (`call_id`, `name`, `arguments`) or a tool's result, `function_call_output` (`call_id`,
    `output`)."""
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Union[str, list[ContentPart], None] = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses."""
    model: Annotated[str, Meta(min_length=1, description="the base model's name or an adapter's name")]
    input: Union[str, Annotated[list[InputItem], Meta(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=2 ** 63 - 1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: Any = None          # refused: the server keeps no responses


# -- the answer -------------------------------------------------------------------------------------------
class OutputText(_Shape, kw_only=True):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class MessageItem(_Shape, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(_Shape, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[MessageItem, FunctionCallItem]


class InputTokensDetails(_Shape, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(_Shape, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(_Shape, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Shape, kw_only=True):
    reason: Literal["max_output_tokens"]


class Response(_Shape, kw_only=True):
    """The answer (whole, or in the stream's first and last events)."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict
    metadata: dict[str, str]
    store: bool
    previous_response_id: None


# -- the stream's events (each has its `type` and a `sequence_number` counting from 0) -------------------
class _Event(_Shape, kw_only=True, tag_field="type"):
    sequence_number: int


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


StreamEvent = Union[ResponseCreated, ResponseInProgress, ResponseCompleted, ResponseIncomplete, OutputItemAdded,
                    OutputItemDone, ContentPartAdded, ContentPartDone, OutputTextDelta, OutputTextDone,
                    ArgumentsDelta, ArgumentsDone]


# -- the request as a chat request -----------------------------------------------------------------------
def to_chat(req: ResponsesRequest) -> dict:
    """The chat completions body that asks the same (validated again as a ChatCompletionRequest); 400
    naming the Responses field for what has no meaning here."""
    if req.previous_response_id is not None:
        raise ApiError(400, "'previous_response_id' is not supported: this server keeps no responses; send the "
                       "conversation in 'input'", "previous_response_id")
    if req.store:
        raise ApiError(400, "'store' true is not supported: this server keeps no responses", "store")
    body: dict = {"model": req.model, "messages": _messages(req)}
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("stream", req.stream), ("user", req.user),
                        ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            k: v for k, v in (("name", t.name), ("description", t.description), ("parameters", t.parameters),
                              ("strict", t.strict)) if v is not None}} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise ApiError(400, "'text': format json_schema needs its schema", "text")
        body["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "answer", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}
    return body


def _messages(req: ResponsesRequest) -> list[dict]:
    turns = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return turns + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, f"'input': item {i} (function_call) needs call_id, name and arguments", "input")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls"):
                turns[-1]["tool_calls"].append(call)        # parallel calls: one assistant turn
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise ApiError(400, f"'input': item {i} (function_call_output) needs call_id and output", "input")
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            if item.role is None or item.content is None:
                raise ApiError(400, f"'input': item {i} (a message) needs role and content", "input")
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            turns.append({"role": item.role, "content": text})
    return turns


class ResponsesChat(ChatCompletionRequest, kw_only=True):
    """The chat request a Responses request became, with that request beside it (for the answer's echo)."""
    origin: Any = None
