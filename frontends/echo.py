"""How a choice's text and logprobs are shown: as they are (`Plain`), or with the prompt first (`Echo`,
OpenAI completions' `echo`)."""
from __future__ import annotations

from frontends.logprobs_format import echo_logprobs


class Plain:
    """The completion as it is. `format_logprobs(entries, offset)` formats a choice's logprobs from text
    offset `offset`; `token_text(id)` is one token's text."""
    prompt: str | None = None
    prompt_only = False

    def __init__(self, format_logprobs, token_text):
        self.format, self.token_text = format_logprobs, token_text

    def text(self, completion: str, first: bool) -> str:
        return completion

    def logprobs(self, entries, prompt_lps, offset: int, first: bool):
        return self.format(entries, offset)


class Echo(Plain):
    """With `echo`, the prompt (text `prompt`, tokens `ids`) comes first; with echo and max_tokens 0
    (`prompt_only`), only the prompt (the one token computed is dropped: how evaluation harnesses score a
    text)."""

    def __init__(self, prompt: str, ids: list[int], prompt_only: bool, format_logprobs, token_text):
        super().__init__(format_logprobs, token_text)
        self.prompt, self.ids, self.prompt_only = prompt, ids, prompt_only

    def text(self, completion: str, first: bool) -> str:
        return (self.prompt if first else "") + ("" if self.prompt_only else completion)

    def logprobs(self, entries, prompt_lps, offset: int, first: bool):
        entries = [] if self.prompt_only else entries
        if not first:
            return self.format(entries, offset)
        head = echo_logprobs(self.ids, prompt_lps or [None] * len(self.ids), self.token_text)
        return head + self.format(entries, offset + len(self.prompt))
