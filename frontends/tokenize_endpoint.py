"""POST /tokenize and /detokenize (vLLM's routes): a client counts and checks its prompts with the server's
own tokenizer and chat template before it sends them.

/tokenize gives exactly the ids the generation routes would run on (it calls their own `prompt()`): a
`prompt` as /v1/completions tokenizes it, `messages` through the chat template as /v1/chat/completions
does. `model` must be the base model's or an adapter's name the caller may use (the same 404 as the
generation routes otherwise; adapters share the base model's tokenizer). Both need a key when keys are
configured, as /v1/* does.
"""
from __future__ import annotations

from aiohttp import web

from frontends import api_requests, request_fields
from frontends import api_responses as r
from frontends.api_error import ApiError
from frontends.api_requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from frontends.chat_endpoint import ChatEndpoint
from frontends.completions_endpoint import CompletionsEndpoint
from frontends.error_middleware import no_such_model
from frontends.reply import reply


class TokenizeEndpoints:
    def __init__(self, completions: CompletionsEndpoint, chat: ChatEndpoint):
        self.completions, self.chat, self.client = completions, chat, completions.client

    def check_model(self, request: web.Request, model: str) -> None:
        """404 unless `model` is the base model or a known adapter, one the caller may use."""
        status = self.client.status
        self.completions.adapter_for(request, model)              # 404 for one the caller may not use
        if model != status.model and model not in status.adapters:
            raise ApiError(404, no_such_model(model), "model", "model_not_found")

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await api_requests.read(request, TokenizeRequest)
        self.check_model(request, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools,
                                         tool_choice="none" if req.tools else None,    # the tools reach the template
                                         chat_template_kwargs=req.chat_template_kwargs)
            [(ids, _)] = self.chat.prompts(chat)
        else:
            [(ids, _)] = self.completions.prompts(CompletionRequest(model=req.model, prompt=req.prompt))
        return reply(r.TokenizeReply(count=len(ids), max_model_len=self.client.status.max_model_len, tokens=ids))

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await api_requests.read(request, DetokenizeRequest)
        self.check_model(request, req.model)
        request_fields.check_token_ids(req.tokens, self.client.status.vocab_size, "tokens")
        return reply(r.DetokenizeReply(prompt=self.completions.tokenizer.decode(req.tokens)))
