"""One generation request as the scheduler sees it: tokens, progress and blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ipc.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    """Invariant: num_computed_tokens <= num_tokens; the KV of tokens [0, num_computed_tokens) is in
    `block_ids`. Prefill and decode are the same thing: compute the tokens not yet computed."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    adapter_id: int = 0
    cache_salt: str | None = None
    tenant: str = ""
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0   # leading blocks already registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    blocked_by_cap: int = 0      # steps held back by the max_loras cap or a pool full of running adapters
    cold_start: bool = False     # had to wait for its adapter to load
    load_wait_start: float | None = None   # time.monotonic() when it first found its adapter not resident
    counted: bool = False        # counted in the adapter hit/cold-start statistics
    # with params.prompt_logprobs: entry i for prompt token i (None for the first), filled as chunks run
    prompt_logprobs: list | None = None
    num_resumed: int = 0         # the last prompt tokens are earlier output (resent after an engine restart)
    suspect: bool = False        # was in a step that failed: runs alone until it samples a token (Scheduler)
    grammar: object = None       # with params.structured_outputs: its Matcher (engine/structured_output.py)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token; return why the request stops now, if it does."""
        self.output_token_ids.append(token)
        p = self.params
        if self.grammar is not None and (not self.grammar.accept(token) or self.grammar.done):
            return FinishReason.STOP           # its constraint is complete (or, never expected, broken)
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.max_tokens:
            return FinishReason.LENGTH
        return None
