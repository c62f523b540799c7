"""POST /v1/chat/completions: messages rendered with the chat template (the model's, or the server's
--chat-template), answered with `ChatCompletion` (whole) or `ChatCompletionChunk` (streamed) structs;
`logprobs` is a boolean with `top_logprobs` alternatives; `tools` and `tool_choice` as OpenAI's
(frontends/tool_calls.py)."""
from __future__ import annotations

import json
import time

from jinja2 import TemplateError

from engine.tokenizer import encode_chat
from frontends import api_responses as r
from frontends import request_fields
from frontends.api_error import ApiError
from frontends.api_requests import AssistantTurn, ChatCompletionRequest, ChatMessage, ToolMessage
from frontends.echo import Plain
from frontends.generation_endpoint import GenerationEndpoint
from frontends.logprobs_format import chat_logprobs
from frontends.tool_calls import ToolView, tool_plan


class ChatEndpoint(GenerationEndpoint):
    request_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    prompt_field = "messages"
    default_max_tokens = None                    # up to the context, as OpenAI's chat
    refused = {**{k: v for k, v in request_fields.UNSUPPORTED.items() if k not in ("tools", "tool_choice")},
               "echo": (False,)}                 # echo: completions only

    def __init__(self, *args, tool_parser: str | None = None, chat_template: str | None = None, **kw):
        """tool_parser: --tool-call-parser (frontends/tool_parsers.py), which tool_choice "auto" needs;
        chat_template: --chat-template's text (None: the model's own)."""
        super().__init__(*args, **kw)
        self.tool_parser, self.chat_template = tool_parser, chat_template

    def prompts(self, req: ChatCompletionRequest) -> list[tuple[list[int], str | None]]:
        plan = tool_plan(req, self.tool_parser)
        try:
            return [(encode_chat(self.tokenizer, template_messages(req.messages), plan.tools if plan else None,
                                 self.chat_template, req.chat_template_kwargs, bool(req.continue_final_message)),
                     None)]
        except (ValueError, TypeError, TemplateError) as e:   # no template, or one that refuses these messages
            if str(e).startswith("chat_template_kwargs"):
                raise ApiError(400, str(e), "chat_template_kwargs") from None
            raise ApiError(400, f"'messages': {e}", "messages") from None

    def constraint(self, req: ChatCompletionRequest):
        plan = tool_plan(req, self.tool_parser)
        return plan.constraint if plan else None

    def view(self, req, ids: list[int], echo: str | None, prompt_only: bool) -> Plain:
        plan = tool_plan(req, self.tool_parser)
        if plan is None:
            return super().view(req, ids, echo, prompt_only)
        return ToolView(plan, self.format_logprobs, self.token_text)

    def logprobs_count(self, req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        return None if not req.logprobs else (req.top_logprobs or 0)

    def format_logprobs(self, entries: list, offset: int) -> r.ChatLogprobs:
        return chat_logprobs(entries, self.token_text)

    def answer(self, rid: str, model: str, choices: list[tuple], usage: r.Usage) -> r.ChatCompletion:
        return r.ChatCompletion(id=rid, object="chat.completion", created=int(time.time()), model=model, usage=usage,
                                choices=[_choice(i, *c) for i, c in enumerate(choices)])

    def chunk(self, rid, model, index, text, finish, first, logprobs, view) -> r.ChatCompletionChunk | None:
        if isinstance(view, ToolView):
            delta, finish = view.delta(text, finish, first)
            if not (first or finish or logprobs or delta.content or delta.tool_calls):
                return None
        else:
            delta = r.Delta(role="assistant" if first else None, content=text)
        return r.ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=int(time.time()), model=model,
                                     choices=[r.ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                                                logprobs=logprobs)])

    def usage_chunk(self, rid: str, model: str, usage: r.Usage) -> r.ChatCompletionChunk:
        return r.ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=int(time.time()), model=model,
                                     choices=[], usage=usage)


def _choice(index: int, text: str, finish: str | None, logprobs, view) -> r.ChatChoice:
    if isinstance(view, ToolView):
        message, finish = view.message(text, finish)
    else:
        message = r.AssistantMessage(role="assistant", content=text)
    return r.ChatChoice(index=index, message=message, finish_reason=finish, logprobs=logprobs)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as chat templates take it: string content ("" for an assistant turn that only
    calls tools), an assistant turn's `tool_calls` with their arguments as objects (what templates
    render), a tool turn's `tool_call_id` and `name`."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if m.content is None or isinstance(m.content, str) else "".join(p.text for p in m.content)
        if content is None and not (isinstance(m, AssistantTurn) and m.tool_calls):
            raise ApiError(400, f"'messages': messages[{i}] has no content (only an assistant turn with tool_calls "
                           f"may leave it out)", "messages")
        turn: dict = {"role": m.role, "content": content or ""}
        if getattr(m, "tool_calls", None):
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            turn.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
        out.append(turn)
    return out


def _arguments(text: str):
    """A call's arguments as the object they encode (templates render them with `tojson`), else as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
