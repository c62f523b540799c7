"""Which frontend asked for each request, and what it is sent: every delta of a streamed request as it
comes, a non-streamed request's outputs accumulated into one, sent when it finishes."""
from __future__ import annotations

from ipc.outputs import RequestOutput


class RequestRoutes:
    def __init__(self):
        self.owner: dict[str, bytes] = {}             # request id -> frontend identity
        self.stream: dict[str, bool] = {}
        self.pending: dict[str, RequestOutput] = {}    # non-streamed requests: their output so far

    def add(self, request_id: str, identity: bytes, stream: bool) -> None:
        self.owner[request_id] = identity
        self.stream[request_id] = stream

    def owned_by(self, identity: bytes) -> list[str]:
        return [rid for rid, owner in self.owner.items() if owner == identity]

    def route(self, d: RequestOutput) -> tuple[bytes, RequestOutput] | None:
        """(frontend, what to send it) for this delta, or None: nothing to send now (an unknown request, or
        a non-streamed one not finished yet). A finished request is forgotten."""
        identity = self.owner.get(d.request_id)
        if identity is None:
            return None
        if not self.stream.get(d.request_id, True):
            d = self._accumulate(d)
        if d is not None and d.finish_reason is not None:
            self.forget(d.request_id)
        return None if d is None else (identity, d)

    def _accumulate(self, d: RequestOutput) -> RequestOutput | None:
        acc = self.pending.get(d.request_id)
        if acc is None:
            acc = self.pending[d.request_id] = RequestOutput(d.request_id)
        acc.token_ids = acc.token_ids + d.token_ids
        acc.logprobs = acc.logprobs + d.logprobs
        if d.prompt_logprobs is not None:
            acc.prompt_logprobs = d.prompt_logprobs
        acc.text += d.text
        acc.prompt_tokens, acc.completion_tokens = d.prompt_tokens, d.completion_tokens
        acc.cached_tokens = d.cached_tokens
        acc.finish_reason, acc.error, acc.status = d.finish_reason, d.error, d.status
        return self.pending.pop(d.request_id) if d.finish_reason is not None else None

    def forget(self, request_id: str) -> None:
        self.owner.pop(request_id, None)
        self.stream.pop(request_id, None)
        self.pending.pop(request_id, None)
