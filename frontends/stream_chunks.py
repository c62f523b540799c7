"""The chunks of one streamed answer (OpenAI's `*.chunk` objects) from the outputs of its `n` choices."""
from __future__ import annotations

import time

from frontends import openai_protocol as oai
from frontends.echo import Echo


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reason for the engine's (an aborted request stopped)."""
    return "stop" if reason == "abort" else reason


class StreamChunks:
    """Per choice: whether its first chunk went out (it carries the role, and the prompt under echo), how
    many characters of text it has sent (the logprobs' text offsets), and its final output.
    Invariant: a choice's chunks are built in the order of its outputs."""

    def __init__(self, n: int, rid: str, model: str, chat: bool, view: Echo):
        self.rid, self.model, self.chat, self.view = rid, model, chat, view
        self.started, self.sent, self.finals = [False] * n, [0] * n, [None] * n

    def chunk(self, i: int, out) -> dict | None:
        """The chunk for output `out` of choice i (None: it has nothing to show)."""
        first = not self.started[i]
        if not (out.text or out.finish_reason or first or out.logprobs):
            return None
        view, lps = self.view, None
        if out.logprobs or (first and out.prompt_logprobs is not None):
            lps = view.logprobs(out.logprobs, out.prompt_logprobs, self.sent[i], first)
        chunk = oai.completion_chunk(self.rid, self.model, view.text(out.text, first), finish_reason(out.finish_reason),
                                     self.chat, first=first, logprobs=lps, index=i)
        self.started[i] = True
        if first and view.prompt is not None:
            self.sent[i] += len(view.prompt)
        self.sent[i] += sum(len(view.token_text(e.token_id)) for e in out.logprobs)
        return chunk

    def finish(self, i: int, out) -> bool:
        """Record choice i's final output; -> whether every choice has finished."""
        self.finals[i] = out
        return all(f is not None for f in self.finals)

    def usage(self) -> dict:
        """The closing chunk with the usage summed over the choices (after every choice finished)."""
        use = oai.choices_usage(self.finals, self.view.prompt_only)
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": [], "usage": use}
