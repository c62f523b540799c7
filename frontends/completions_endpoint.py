"""POST /v1/completions: a prompt (text or token ids) or a batch of them, answered with `Completion` structs;
`echo` puts the prompt before the answer, `logprobs` is an integer (alternatives per token)."""
from __future__ import annotations

import time

from frontends import api_responses as r
from frontends import request_fields
from frontends.api_error import ApiError
from frontends.api_requests import MAX_PROMPTS, CompletionRequest
from frontends.echo import Echo, Plain
from frontends.generation_endpoint import GenerationEndpoint
from frontends.logprobs_format import completion_logprobs


class CompletionsEndpoint(GenerationEndpoint):
    request_type = CompletionRequest
    id_prefix = "cmpl"
    prompt_field = "prompt"
    default_max_tokens = 16                      # OpenAI's default for completions
    refused = request_fields.UNSUPPORTED

    def prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        prompts = batch(req.prompt)
        out = []
        for p, prompt in enumerate(prompts):
            with request_fields.batch_member(p, len(prompts)):
                out.append(self._one(prompt, bool(req.echo)))
        return out

    def _one(self, prompt: str | list[int], echo: bool) -> tuple[list[int], str | None]:
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        request_fields.check_token_ids(ids, self.client.status.vocab_size)      # before echo decodes them
        if not echo:
            return ids, None
        return ids, prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def logprobs_count(self, req: CompletionRequest) -> int | None:
        return req.logprobs

    def format_logprobs(self, entries: list, offset: int) -> r.CompletionLogprobs:
        return completion_logprobs(entries, self.token_text, offset)

    def view(self, req, ids: list[int], echo: str | None, prompt_only: bool) -> Plain:
        if echo is None:
            return super().view(req, ids, echo, prompt_only)
        return Echo(echo, ids, prompt_only, self.format_logprobs, self.token_text)

    def answer(self, rid: str, model: str, choices: list[tuple], usage: r.Usage) -> r.Completion:
        return r.Completion(id=rid, object="text_completion", created=int(time.time()), model=model, usage=usage,
                            choices=[r.CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=lps)
                                     for i, (text, finish, lps, _) in enumerate(choices)])

    def chunk(self, rid, model, index, text, finish, first, logprobs, view) -> r.Completion:
        return r.Completion(id=rid, object="text_completion", created=int(time.time()), model=model,
                            choices=[r.CompletionChoice(index=index, text=text, finish_reason=finish,
                                                        logprobs=logprobs)])

    def usage_chunk(self, rid: str, model: str, usage: r.Usage) -> r.Completion:
        return r.Completion(id=rid, object="text_completion", created=int(time.time()), model=model, choices=[],
                            usage=usage)


def batch(prompt) -> list[str | list[int]]:
    """The prompts of a `prompt` field: one string or token-id array, or a batch of either (not mixed)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if prompt and (all(isinstance(t, str) for t in prompt) or all(isinstance(t, list) for t in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"'prompt' is a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} in one call",
                           "prompt")
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string, an array of token ids, or a batch: an array of strings or of "
                   "token-id arrays (one kind, not empty)", "prompt")
