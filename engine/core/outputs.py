"""What one engine step reports per request, before detokenization."""
from __future__ import annotations

from typing import NamedTuple


class TokenOutput(NamedTuple):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list = []          # TokenLogprobs per new token, when the request asked for them
    prompt_logprobs: list | None = None   # with the first token, when asked: per prompt token (None first)
    error: str | None = None     # why the engine gave up on the request (finish_reason "abort")
    status: int = 0              # with `error`: its HTTP status (0: 500, the engine gave up; 404: its adapter failed)
