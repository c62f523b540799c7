"""The typed request bodies of the HTTP API: what the server decodes requests with and what `/openapi.json`
is generated from (`frontends/openapi.py`), so the document and the validation cannot drift. (The answers
are typed in `api_responses.py`.)

Requests are decoded with `decode(raw, type)`: a wrong type, a missing field or a value out of a declared
range is a 400 naming the field. Fields a client may send as `null` mean "the default". Unknown fields are
ignored (OpenAI clients send some this server has no use for); fields of OpenAI's API that the server does
not implement are declared loosely so that the server can refuse them by name (`request_fields.UNSUPPORTED`).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from frontends.api_error import ApiError
from ipc.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, StructuredOutputsParams

MAX_CHOICES = 16
MAX_PROMPTS = 64      # prompts in one /v1/completions call (a batch), each with its `n` choices
TokenId = Annotated[int, Meta(ge=0, le=2 ** 63 - 1, description="a token id of the model's vocabulary")]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`: the schema the answer follows (`strict` or not, it does)."""
    name: str | None = None
    description: str | None = None
    schema_: dict | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or `json_schema`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class AdapterWeight(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One adapter of a composition: output = W x + sum_i scale_i * (alpha_i / r_i) * B_i A_i x."""
    name: Annotated[str, Meta(min_length=1, description="an adapter's name")]
    scale: Annotated[float, Meta(ge=-10.0, le=10.0)] = 1.0


class Generation(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's sampling extensions)."""
    model: Annotated[str, Meta(min_length=1, description="the base model's name or an adapter's name")]
    max_tokens: Annotated[int, Meta(ge=0, le=2 ** 63 - 1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=2 ** 63 - 1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2 ** 63 - 1, description="-1 or 0: off")] | None = None
    seed: Annotated[int, Meta(ge=0, le=2 ** 63 - 1)] | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=2 ** 63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    adapters: Annotated[list[AdapterWeight], Meta(
        min_length=1, description="several adapters on this request, each with its scale, added (with `model` "
                                  "the base model's name, or an adapter's, which then joins them with scale 1.0); "
                                  "at most the server's --max-adapters-per-request")] | None = None
    user: str | None = None
    # the output's constraint (frontends/structured_fields.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI / vLLM fields this server does not implement: refused by name unless they say "off"
    suffix: Any = None
    best_of: Any = None
    functions: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None


class CompletionRequest(Generation, kw_only=True):
    """POST /v1/completions. `prompt`: a string or an array of token ids; or a batch, as OpenAI's: an array of
    strings, or of token-id arrays (at most MAX_PROMPTS), whose answer's choice `p * n + i` is prompt p's i-th."""
    prompt: Union[str, list[Union[TokenId, str, list[TokenId]]]]
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Any = None           # chat only: refused here
    tool_choice: Any = None


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description=(
    "a function's name: 1-64 letters, digits, '_', '-', '.' or ':'"))]


class FunctionCall(msgspec.Struct, kw_only=True):
    """A call the assistant made, as OpenAI's answers give it back: `arguments` is JSON text."""
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """One entry of an assistant message's `tool_calls` (a turn sent back in the conversation)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Turn(msgspec.Struct, kw_only=True, tag_field="role"):
    """One turn of a conversation, by its `role` (OpenAI's roles, nothing else)."""
    content: Union[str, list[TextPart]]
    name: str | None = None

    @property
    def role(self) -> str:
        return type(self).__struct_config__.tag


class SystemMessage(_Turn, tag="system"):
    pass


class DeveloperMessage(_Turn, tag="developer"):
    pass


class UserMessage(_Turn, tag="user"):
    pass


class AssistantTurn(_Turn, tag="assistant"):
    """An earlier answer: its text, or its `tool_calls` (then `content` may be null or left out)."""
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Turn, tag="tool"):
    """A tool's result for the call `tool_call_id` names."""
    tool_call_id: str


ChatMessage = Union[SystemMessage, DeveloperMessage, UserMessage, AssistantTurn, ToolMessage]


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = msgspec.field(default=None)     # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    """OpenAI's tool definition: a function the model may call."""
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice` naming one function: the answer is a call of it."""
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(Generation, kw_only=True):
    """POST /v1/chat/completions. With `tools`: `tool_choice` "none" (text only), "auto" (the model decides;
    needs the server's --tool-call-parser), "required" (one call or more, any of the tools) or a named
    function (a call of it); frontends/tool_calls.py."""
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Meta(max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None      # vLLM's: more variables for the chat template
    continue_final_message: bool | None = None              # vLLM's: the last turn is continued, not answered
    echo: Any = None     # completions only: refused here


class LoadLoraRequest(msgspec.Struct, kw_only=True):
    """POST /v1/load_lora_adapter (admin). Without `lora_path`, the adapter's folder under --adapter-dir."""
    lora_name: str
    lora_path: str | None = None
    pinned: bool | None = None


class UnloadLoraRequest(msgspec.Struct, kw_only=True):
    """POST /v1/unload_lora_adapter (admin)."""
    lora_name: str


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize (vLLM's route): the token ids a generation would run on, exactly one of `prompt` (as
    /v1/completions tokenizes it) and `messages` (through the chat template, as /v1/chat/completions does)."""
    model: Annotated[str, Meta(min_length=1, description="the base model's name or an adapter's name")]
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: Annotated[list[ChatTool], Meta(max_length=128)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize (vLLM's route): token ids back to text."""
    model: Annotated[str, Meta(min_length=1, description="the base model's name or an adapter's name")]
    tokens: list[TokenId]


class DecodeFailure(ValueError):
    """A body that does not fit its type: `message` for the client, `param` the top-level field."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


_AT = re.compile(r" - at `(\$\.(\w+)\S*)`$")
_MISSING = re.compile(r"missing required field `(\w+)`")


def decode(raw: bytes, type_: type):
    """Decode a request body (strict JSON, valid UTF-8) into its typed request, or raise DecodeFailure."""
    try:
        return msgspec.json.decode(raw, type=type_)
    except UnicodeDecodeError:  # msgspec < 0.23 (0.23 raises a DecodeError, below)
        raise DecodeFailure(_NOT_UTF8, None) from None
    except RecursionError:
        raise DecodeFailure("the request body is not valid JSON: nested too deeply", None) from None
    except msgspec.ValidationError as e:
        raise _failure(str(e)) from None
    except msgspec.DecodeError as e:
        raise _undecodable(raw, str(e)) from None


_NOT_UTF8 = "the request body is not valid UTF-8"
# a \u escape of a high surrogate not followed by a low one, or a low one without its high one
_HIGH, _LOW = r"\\u[dD][89abAB][0-9a-fA-F]{2}", r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE = re.compile(rf"{_HIGH}(?!{_LOW})|(?<!{_HIGH}){_LOW}")


def _undecodable(raw: bytes, reason: str) -> DecodeFailure:
    """Why msgspec could not parse `raw`, in words that do not depend on its version: the bytes are not
    UTF-8, or a \\u escape is a lone UTF-16 surrogate (msgspec says "truncated"), or msgspec's reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return DecodeFailure(_NOT_UTF8, None)
    lone = _LONE.search(text)
    if lone is not None:
        return DecodeFailure(f"the request body is not valid JSON: {lone.group(0)} is a lone UTF-16 surrogate",
                             None)
    return DecodeFailure(f"the request body is not valid JSON: {reason}", None)


def _failure(text: str) -> DecodeFailure:
    """msgspec's "Expected `int` <= 16 - at `$.n`" as "'n': Expected `int` <= 16" (with the path when the
    culprit lies deeper than the top-level field)."""
    at = _AT.search(text)
    if at is not None:
        detail, path, param = text[:at.start()], at.group(1), at.group(2)
        missing = _MISSING.search(detail)
        if path == f"$.{param}" and not missing:
            return DecodeFailure(f"'{param}': {detail}", param)
        return DecodeFailure(f"'{param}': {detail} (at {path})", param)
    missing = _MISSING.search(text)
    if missing is not None:
        return DecodeFailure(f"'{missing.group(1)}' is required", missing.group(1))
    if text.startswith("Expected `object`"):
        return DecodeFailure("the request body must be a JSON object", None)
    return DecodeFailure(f"invalid request: {text}", None)


async def read(request, type_: type):
    """An aiohttp request's body as its typed request: strict JSON (no NaN or Infinity), valid UTF-8 (no
    lone surrogates), every field of its declared type and range; ApiError 400 naming the field otherwise."""
    try:
        return decode(await request.read(), type_)
    except DecodeFailure as e:
        raise ApiError(400, e.message, e.param) from None
