"""How a model writes tool calls into its text, for `tool_choice` "auto" (the server's --tool-call-parser):
each parser takes a choice's text as it streams in and separates what is content from the calls.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among the text (Hermes 2 Pro
  and later, Qwen2.5 and Qwen3, and adapters trained on their templates).
- `llama3_json`: an answer that is one JSON object `{"name": ..., "parameters": {...}}`, or several joined
  by `;` (Llama 3.1 / 3.2's JSON tool calling); an answer starting with anything else is content.

Invariant for both: the content they give back plus the calls' blocks are the whole text, in order; a
block that does not parse as a call is given back as content, unchanged.
"""
from __future__ import annotations

import json

Call = tuple[str, str]          # (function name, arguments as JSON text)


def parse_call(text: str) -> Call | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` -> (name, arguments JSON); None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return _as_call(obj)


def _as_call(obj) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                 # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buf, self.inside, self.called = "", False, False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content that is certain so far and the calls completed by `text`. Text that may be the start
        of a `<tool_call>` tag is held back until the next piece tells; once a call was made, whitespace
        alone between blocks is dropped."""
        self.buf += text
        content, calls = [], []

        def say(segment: str) -> None:
            if segment.strip() or not self.called:
                content.append(segment)
        while True:
            if not self.inside:
                at = self.buf.find(self.START)
                if at < 0:
                    keep = _partial_tag(self.buf, self.START)
                    say(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                say(self.buf[:at])
                self.buf, self.inside = self.buf[at + len(self.START):], True
            else:
                at = self.buf.find(self.END)
                if at < 0:
                    break
                block, self.buf, self.inside = self.buf[:at], self.buf[at + len(self.END):], False
                call = parse_call(block.strip())
                if call is None:
                    content.append(self.START + block + self.END)
                else:
                    calls.append(call)
                    self.called = True
        return "".join(content), calls

    def end(self) -> tuple[str, list[Call]]:
        """What is left when the choice ends: an unclosed block is a call if it parses (a model may stop
        before its closing tag), else content."""
        rest, inside = self.buf, self.inside
        self.buf, self.inside = "", False
        if not inside:
            return ("" if self.called and not rest.strip() else rest), []
        call = parse_call(rest.strip())
        return ("", [call]) if call is not None else (self.START + rest, [])


class Llama3JsonParser:
    def __init__(self) -> None:
        self.buf, self.mode = "", None          # mode: None (undecided), "json" (held to the end), "text"

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.mode == "text":
            return text, []
        self.buf += text
        head = self.buf.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not head:
            return "", []
        if head[0] == "{":
            self.mode = "json"
            return "", []
        self.mode, out, self.buf = "text", self.buf, ""
        return out, []

    def end(self) -> tuple[str, list[Call]]:
        text, self.buf = self.buf, ""
        if self.mode != "json":
            return text, []
        calls = _json_calls(text.lstrip().removeprefix("<|python_tag|>"))
        return ("", calls) if calls else (text, [])


def _json_calls(text: str) -> list[Call]:
    """Objects separated by `;` (and whitespace), each a call; [] unless all of the text is such calls."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return calls
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return []
        call = _as_call(obj)
        if call is None:
            return []
        calls.append(call)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
