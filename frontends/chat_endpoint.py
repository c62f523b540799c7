"""POST /v1/chat/completions: messages rendered with the model's chat template, answered with
`ChatCompletion` (whole) or `ChatCompletionChunk` (streamed) structs; `logprobs` is a boolean with
`top_logprobs` alternatives."""
from __future__ import annotations

import time

from jinja2 import TemplateError

from engine.tokenizer import encode_chat
from frontends import api_responses as r
from frontends import request_fields
from frontends.api_error import ApiError
from frontends.api_requests import ChatCompletionRequest
from frontends.generation_endpoint import GenerationEndpoint
from frontends.logprobs_format import chat_logprobs


class ChatEndpoint(GenerationEndpoint):
    request_type = ChatCompletionRequest
    id_prefix = "chatcmpl"
    prompt_field = "messages"
    default_max_tokens = None                    # up to the context, as OpenAI's chat
    refused = {**request_fields.UNSUPPORTED, "echo": (False,)}      # echo: completions only

    def prompts(self, req: ChatCompletionRequest) -> list[tuple[list[int], str | None]]:
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in req.messages]
        try:
            return [(encode_chat(self.tokenizer, messages), None)]
        except (ValueError, TemplateError) as e:       # no chat template, or one that refuses these messages
            raise ApiError(400, f"'messages': {e}", "messages") from None

    def logprobs_count(self, req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        return None if not req.logprobs else (req.top_logprobs or 0)

    def format_logprobs(self, entries: list, offset: int) -> r.ChatLogprobs:
        return chat_logprobs(entries, self.token_text)

    def answer(self, rid: str, model: str, choices: list[tuple], usage: r.Usage) -> r.ChatCompletion:
        return r.ChatCompletion(
            id=rid, object="chat.completion", created=int(time.time()), model=model, usage=usage,
            choices=[r.ChatChoice(index=i, message=r.AssistantMessage(role="assistant", content=text),
                                  finish_reason=finish, logprobs=lps) for i, (text, finish, lps) in enumerate(choices)])

    def chunk(self, rid, model, index, text, finish, first, logprobs) -> r.ChatCompletionChunk:
        delta = r.Delta(role="assistant" if first else None, content=text)
        return r.ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=int(time.time()), model=model,
                                     choices=[r.ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                                                logprobs=logprobs)])

    def usage_chunk(self, rid: str, model: str, usage: r.Usage) -> r.ChatCompletionChunk:
        return r.ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=int(time.time()), model=model,
                                     choices=[], usage=usage)
