"""POST /v1/completions: a prompt (text or token ids), answered with `Completion` structs; `echo` puts the
prompt before the answer, `logprobs` is an integer (alternatives per token)."""
from __future__ import annotations

import time

from frontends import api_responses as r
from frontends import request_fields
from frontends.api_error import ApiError
from frontends.api_requests import CompletionRequest
from frontends.echo import Echo, Plain
from frontends.generation_endpoint import GenerationEndpoint
from frontends.logprobs_format import completion_logprobs


class CompletionsEndpoint(GenerationEndpoint):
    request_type = CompletionRequest
    id_prefix = "cmpl"
    prompt_field = "prompt"
    default_max_tokens = 16                      # OpenAI's default for completions
    refused = request_fields.UNSUPPORTED

    def prompt(self, req: CompletionRequest) -> tuple[list[int], str | None]:
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            elif not prompt or not all(isinstance(t, int) for t in prompt):
                raise ApiError(400, "'prompt' must be a string, or an array of token ids (batches are not "
                               "supported)", "prompt")
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        request_fields.check_token_ids(ids, self.client.status.vocab_size)      # before echo decodes them
        if not req.echo:
            return ids, None
        return ids, prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def logprobs_count(self, req: CompletionRequest) -> int | None:
        return req.logprobs

    def format_logprobs(self, entries: list, offset: int) -> r.CompletionLogprobs:
        return completion_logprobs(entries, self.token_text, offset)

    def view(self, ids: list[int], echo: str | None, prompt_only: bool) -> Plain:
        if echo is None:
            return super().view(ids, echo, prompt_only)
        return Echo(echo, ids, prompt_only, self.format_logprobs, self.token_text)

    def answer(self, rid: str, model: str, choices: list[tuple], usage: r.Usage) -> r.Completion:
        return r.Completion(id=rid, object="text_completion", created=int(time.time()), model=model, usage=usage,
                            choices=[r.CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=lps)
                                     for i, (text, finish, lps) in enumerate(choices)])

    def chunk(self, rid, model, index, text, finish, first, logprobs) -> r.Completion:
        return r.Completion(id=rid, object="text_completion", created=int(time.time()), model=model,
                            choices=[r.CompletionChoice(index=index, text=text, finish_reason=finish,
                                                        logprobs=logprobs)])

    def usage_chunk(self, rid: str, model: str, usage: r.Usage) -> r.Completion:
        return r.Completion(id=rid, object="text_completion", created=int(time.time()), model=model, choices=[],
                            usage=usage)
