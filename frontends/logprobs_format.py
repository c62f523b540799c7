"""The engine's per-token logprobs (`ipc.outputs.TokenLogprobs`) in OpenAI's two shapes. `piece(id)` is one
token's text."""
from __future__ import annotations

from frontends.api_responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from ipc.outputs import TokenLogprobs


def completion_logprobs(entries: list[TokenLogprobs], piece, offset: int) -> CompletionLogprobs:
    """The completions object; offset: characters of completion text before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(piece(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[{piece(i): v for i, v in zip(e.top_ids, e.top_logprobs)}
                                            for e in entries], text_offset=offsets)


def echo_logprobs(prompt_ids: list[int], prompt_lps: list[TokenLogprobs | None], piece) -> CompletionLogprobs:
    """An echoed prompt's part of a completion's logprobs: one entry per prompt token, null where there is
    no logprob (the first token, which nothing predicts)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for tok, e in zip(prompt_ids, prompt_lps):
        out.tokens.append(piece(tok))
        out.token_logprobs.append(None if e is None else e.logprob)
        out.top_logprobs.append(None if e is None else {piece(i): v for i, v in zip(e.top_ids, e.top_logprobs)})
        out.text_offset.append(offset)
        offset += len(out.tokens[-1])
    return out


def chat_logprobs(entries: list[TokenLogprobs], piece) -> ChatLogprobs:
    """The chat object: per token its text, logprob, UTF-8 bytes and alternatives."""
    def top(i: int, v: float) -> TopLogprob:
        s = piece(i)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode()))

    def entry(e: TokenLogprobs) -> TokenLogprob:
        s = piece(e.token_id)
        return TokenLogprob(token=s, logprob=e.logprob, bytes=list(s.encode()),
                            top_logprobs=[top(i, v) for i, v in zip(e.top_ids, e.top_logprobs)])
    return ChatLogprobs(content=[entry(e) for e in entries])
