"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: a token that ends inside a multi-byte character waits for the
next, and the last `max(len(stop)) - 1` characters are held back until they can no longer start a stop
string. Invariant: the concatenation of all deltas equals the final `text`.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class Detokenizer:
    def __init__(self, tok: PreTrainedTokenizerBase, prompt_ids: list[int], stop: list[str],
                 include_stop: bool = False):
        self.tok = tok
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:     # a fast tokenizer: what tok.decode returns, without its wrapper's overhead
            return backend.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _append_token(self, token: int) -> None:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _check_stop(self, searched_from: int) -> None:
        for s in self.stop:
            at = self.text.find(s, max(0, searched_from - len(s) + 1))
            if at != -1:
                self.text = self.text[: at + len(s) if self.include_stop else at]
                self.stopped = True
                return

    def resume(self, ids: list[int], sent_chars: int) -> None:
        """Replay output tokens a previous engine already produced, of whose text the client has the first
        `sent_chars` characters: later deltas continue exactly after them."""
        for t in ids:
            self._append_token(t)
        self.sent = min(sent_chars, len(self.text))

    def update(self, new_ids: list[int], finished: bool) -> str:
        """Feed new tokens; return the newly stable text. Sets `stopped` when a stop string appears
        (the text is then cut at it and everything after is dropped)."""
        if self.stopped:
            return ""
        for t in new_ids:
            before = len(self.text)
            self._append_token(t)
            if self.stop:
                self._check_stop(before)
                if self.stopped:
                    break
        if finished and not self.stopped:
            # flush a dangling partial character, if any
            done = len(self._decode(self.ids[self.prefix_offset:self.read_offset]))
            tail = self._decode(self.ids[self.prefix_offset:])[done:]
            self.text += tail
            self.read_offset = self.prefix_offset = len(self.ids)
        end = len(self.text) if finished or self.stopped else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
