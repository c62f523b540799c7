"""The typed answers of the HTTP API, in OpenAI's shapes: the server builds these structs and sends their
msgspec encoding (`encode`), and `/openapi.json` declares the same structs (`frontends/openapi.py`), so the
document is what goes on the wire. The requests are typed in `api_requests.py`.

Conventions: a field without a default is always sent (`null` when None: OpenAI sends `"logprobs": null`);
a field with a default is left out while it has it (`omit_defaults`): usage's `prompt_tokens_details`
only when tokens came from the cache, a model's `max_model_len` only on the base model. So no field that
must always be sent has a default.
"""
from __future__ import annotations

from typing import Literal

import msgspec

encode = msgspec.json.encode


class _Shape(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The base of every answer struct (see the module's conventions)."""


# -- errors ---------------------------------------------------------------------------------------------
class ErrorDetail(_Shape, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Shape, kw_only=True):
    """Every error, in OpenAI's shape."""
    error: ErrorDetail


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    """The error answer for an HTTP status (its OpenAI `type` follows from the status)."""
    return ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"),
                                           param=param, code=code))


# -- usage and logprobs -----------------------------------------------------------------------------------
class PromptTokensDetails(_Shape, kw_only=True):
    cached_tokens: int


class Usage(_Shape, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Shape, kw_only=True):
    """The completions `logprobs` object: per token its text, logprob, alternatives and text offset.
    Invariant: the four lists have one entry per token; an echoed prompt's first token has null entries
    (nothing predicts it)."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, other: "CompletionLogprobs") -> "CompletionLogprobs":
        return CompletionLogprobs(tokens=self.tokens + other.tokens,
                                  token_logprobs=self.token_logprobs + other.token_logprobs,
                                  top_logprobs=self.top_logprobs + other.top_logprobs,
                                  text_offset=self.text_offset + other.text_offset)


class TopLogprob(_Shape, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape, kw_only=True):
    """The chat `logprobs` object."""
    content: list[TokenLogprob]


# -- completions ------------------------------------------------------------------------------------------
class CompletionChoice(_Shape, kw_only=True):
    """A choice of a completion, whole or (streamed) the piece one chunk carries."""
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class Completion(_Shape, kw_only=True):
    """A completion; streamed, each event's data is one of these with the choices' new pieces (the last,
    with `stream_options.include_usage`, has no choices and the usage)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- chat completions -------------------------------------------------------------------------------------
class FunctionCall(_Shape, kw_only=True):
    name: str
    arguments: str                        # JSON text of the arguments


class ToolCall(_Shape, kw_only=True):
    """A call the model made (frontends/tool_calls.py): `id` is what the `tool` turn answering it names."""
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Shape, kw_only=True):
    """`content` null when the answer is only tool calls."""
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Shape, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletion(_Shape, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Shape, kw_only=True):
    name: str | None = None               # on the call's first delta
    arguments: str | None = None          # the next piece of its JSON text


class ToolCallDelta(_Shape, kw_only=True):
    """A piece of the tool call `index` of the choice: its id, type and name on its first piece only."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(_Shape, kw_only=True):
    """What a chunk adds to a choice's message: the role on its first chunk only; text, or tool calls'
    pieces (frontends/tool_calls.py), or neither (a chunk that only carries logprobs or the finish)."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Shape, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(_Shape, kw_only=True):
    """One event of a streamed chat completion (the last, with `stream_options.include_usage`, has no
    choices and the usage)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- models, adapters, health ------------------------------------------------------------------------------
class Model(_Shape, kw_only=True):
    """The base model (`parent` null, with `max_model_len`) or an adapter (`parent`: the base model).
    `replicas`: behind the Ray Serve ingress, the replicas that list it. `digest`: an adapter's content
    ("sha256:..."; names of one content share it, and share their pages and prefix cache), absent for one
    listed in --adapter-dir and not read yet."""
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None = None
    replicas: list[str] | None = None
    digest: str | None = None


class ModelList(_Shape, kw_only=True):
    object: Literal["list"]
    data: list[Model]


class TokenizeReply(_Shape, kw_only=True):
    """POST /tokenize: the ids, their count and the model's context length (prompt + output must fit it)."""
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeReply(_Shape, kw_only=True):
    """POST /detokenize."""
    prompt: str


class StatusReply(_Shape, kw_only=True):
    """/health and the adapter routes. `replicas` and `up`: behind the Ray Serve ingress, how many replicas
    it knows and how many answered."""
    status: str
    message: str | None = None
    replicas: int | None = None
    up: int | None = None
