"""Turns the core's token outputs into text deltas, one Detokenizer per request; `step` is the one
step-to-output loop body that the offline `LLM` and the engine process both run.

A stop string is found here, after the core sampled the token: `step` aborts those requests in the core
with reason "stop". Errors travel inside the outputs (`RequestOutput.error`, status 500: the engine, not
the client, gave up on the request; 404 when the request's adapter failed to load).
"""
from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from engine.core.outputs import TokenOutput
from engine.detokenizer import Detokenizer
from engine.request import FinishReason
from ipc.outputs import RequestOutput

log = logging.getLogger("loraplex.engine")


class OutputProcessor:
    def __init__(self, tok: PreTrainedTokenizerBase):
        self.tok = tok
        self.detok: dict[str, Detokenizer] = {}

    def add(self, request_id: str, prompt_ids: list[int], stop: list[str], include_stop: bool, resumed: int = 0,
            resumed_chars: int = 0) -> None:
        """resumed: the last tokens of prompt_ids are the request's own earlier output, of whose text the
        client has resumed_chars characters (a request resent after an engine restart)."""
        d = Detokenizer(self.tok, prompt_ids[: len(prompt_ids) - resumed], stop, include_stop)
        if resumed:
            d.resume(prompt_ids[len(prompt_ids) - resumed:], resumed_chars)
        self.detok[request_id] = d

    def drop(self, request_id: str) -> None:
        self.detok.pop(request_id, None)

    def process(self, outputs: list[TokenOutput]) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Return (deltas to deliver, ids of requests a stop string finished, ids of requests whose text
        could not be made: each of those ends with an error, and only it)."""
        results, stopped, failed = [], [], []
        for o in outputs:
            d = self.detok.get(o.request_id)
            if d is None:
                continue
            reason, error = o.finish_reason, o.error
            try:
                text = d.update(o.new_token_ids, reason is not None)
            except Exception as e:  # noqa: BLE001 - one request's text must not fail the others in the step
                log.exception("detokenizing request %s failed: failing it", o.request_id)
                text, error = "", f"internal error detokenizing the output: {type(e).__name__}: {e}"
                if reason is None:
                    reason = "abort"
                    failed.append(o.request_id)
            if d.stopped and reason is None:
                reason = "stop"
                stopped.append(o.request_id)
            results.append(RequestOutput(o.request_id, o.new_token_ids, text, reason, o.prompt_tokens,
                                         o.completion_tokens, o.cached_tokens, error=error,
                                         status=(o.status or 500) if error else 0, logprobs=o.logprobs,
                                         prompt_logprobs=o.prompt_logprobs))
            if reason is not None:
                del self.detok[o.request_id]
        return results, stopped, failed

    def step(self, core) -> list[RequestOutput]:
        """Run one step of `core` (an EngineCore) and return its outputs as deltas for the clients; requests
        a stop string finished, or whose text failed, are ended in the core."""
        deltas, stopped, failed = self.process(core.step())
        for rid in stopped:
            core.abort(rid, FinishReason.STOP)
        for rid in failed:
            core.abort(rid)
        return deltas
