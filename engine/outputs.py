"""Results of the offline API, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None     # why the engine gave up on the request (finish_reason "abort")
    # with SamplingParams.logprobs: per token, {token id: logprob} for it and the most likely alternatives
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: per prompt token, {token id: logprob} for it and the most likely
    # alternatives at its position (None for the first token, which nothing predicts)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
