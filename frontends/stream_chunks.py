"""The chunks of one streamed answer (OpenAI's chunk objects) from the outputs of its choices (`n` a prompt)."""
from __future__ import annotations

from frontends.choices import choices_usage
from frontends.echo import Plain


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reason for the engine's (an aborted request stopped)."""
    return "stop" if reason == "abort" else reason


class StreamChunks:
    """Per choice: whether its first chunk went out (it carries the role, and the prompt under echo), how
    many characters of text it has sent (the logprobs' text offsets), and its final output. The chunk
    structs come from the endpoint (`chunk`, `usage_chunk`: frontends/generation_endpoint.py); views[i]
    shows choice i, and every `n` choices share a prompt. Invariant: a choice's chunks are built in the order
    of its outputs."""

    def __init__(self, rid: str, model: str, endpoint, views: list[Plain], n: int):
        self.rid, self.model, self.endpoint, self.views, self.n = rid, model, endpoint, views, n
        count = len(views)
        self.started, self.sent, self.finals = [False] * count, [0] * count, [None] * count

    def chunk(self, i: int, out):
        """The chunk for output `out` of choice i (None: it has nothing to show)."""
        first = not self.started[i]
        if not (out.text or out.finish_reason or first or out.logprobs):
            return None
        view, lps = self.views[i], None
        if out.logprobs or (first and out.prompt_logprobs is not None):
            lps = view.logprobs(out.logprobs, out.prompt_logprobs, self.sent[i], first)
        chunk = self.endpoint.chunk(self.rid, self.model, i, view.text(out.text, first),
                                    finish_reason(out.finish_reason), first, lps, view)
        self.started[i] = True
        if first and view.prompt is not None:
            self.sent[i] += len(view.prompt)
        self.sent[i] += sum(len(view.token_text(e.token_id)) for e in out.logprobs)
        return chunk

    def finish(self, i: int, out) -> bool:
        """Record choice i's final output; -> whether every choice has finished."""
        self.finals[i] = out
        return all(f is not None for f in self.finals)

    def total_usage(self):
        """The usage summed over the choices (after every choice finished)."""
        return choices_usage(self.finals, self.n, self.views[0].prompt_only)

    def usage(self):
        """The closing chunk with the usage (after every choice finished)."""
        return self.endpoint.usage_chunk(self.rid, self.model, self.total_usage())
