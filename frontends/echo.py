"""How a completion's text and logprobs are shown with `echo` (OpenAI completions)."""
from __future__ import annotations

from frontends import openai_protocol as oai


class Echo:
    """With `echo`, the prompt comes first; with echo and max_tokens 0, only the prompt (the one token
    computed is dropped: how evaluation harnesses score a text). Without echo: as they are.
    `format_logprobs(entries, offset)` formats a completion's logprobs from text offset `offset`;
    `token_text(id)` is one token's text."""

    def __init__(self, prompt: str | None, ids: list[int], prompt_only: bool, format_logprobs, token_text):
        self.prompt, self.ids, self.prompt_only = prompt, ids, prompt_only
        self.format, self.token_text = format_logprobs, token_text

    def text(self, completion: str, first: bool) -> str:
        head = self.prompt if first and self.prompt is not None else ""
        return head + ("" if self.prompt_only else completion)

    def logprobs(self, entries, prompt_lps, offset: int, first: bool) -> dict:
        entries = [] if self.prompt_only else entries
        if not (first and self.prompt is not None):
            return self.format(entries, offset)
        head = oai.echo_logprobs(self.ids, prompt_lps or [None] * len(self.ids), self.token_text)
        return oai.join_logprobs(head, self.format(entries, offset + len(self.prompt)))
