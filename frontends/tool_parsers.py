"""How a model writes tool calls into its text, for `tool_choice` "auto" (the server's --tool-call-parser):
each parser takes a choice's text as it streams in and separates what is content from the calls.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among the text (Hermes 2 Pro
  and later, Qwen2.5 and Qwen3, and adapters trained on their templates).
- `llama3_json`: an answer that is one JSON object `{"name": ..., "parameters": {...}}`, or several joined
  by `;` (Llama 3.1 / 3.2's JSON tool calling); an answer starting with anything else is content.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (Mistral 7B v0.3 and
  its fine-tunes; text may come before it; an answer that starts with the array is calls too, for a
  detokenizer that dropped the control token).
- `pythonic`: an answer that is a Python list of calls, `[get_weather(city="Oslo"), get_time()]` (Llama 3.2
  and 4's zero-shot format, ToolACE), keyword arguments of literal values only, read with `ast` (never run).

Invariant for both: the content they give back plus the calls' blocks are the whole text, in order; a
block that does not parse as a call is given back as content, unchanged.
"""
from __future__ import annotations

import ast
import json
from abc import ABC, abstractmethod

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


class _CallsOrText(ABC):
    """An answer that is calls from its first character (after an optional TAG) when that is OPEN, held
    to its end and parsed whole (`parse`, each subclass's format); any other answer is text, streamed as
    it comes."""
    TAG, OPEN = "", ""

    def __init__(self) -> None:
        self.buf, self.mode = "", None          # mode: None (undecided), "calls" (held to the end), "text"

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.mode == "text":
            return text, []
        self.buf += text
        head = self.buf.lstrip().removeprefix(self.TAG).lstrip()
        if not head or _opens(self.TAG, head):
            return "", []
        if head[0] == self.OPEN:
            self.mode = "calls"
            return "", []
        self.mode, out, self.buf = "text", self.buf, ""
        return out, []

    def end(self) -> tuple[str, list[Call]]:
        text, self.buf = self.buf, ""
        if self.mode != "calls":
            return text, []
        calls = self.parse(text.strip().removeprefix(self.TAG).strip())
        return ("", calls) if calls else (text, [])

    @abstractmethod
    def parse(self, body: str) -> list[Call]:
        """The calls `body` (the answer without its TAG) holds; [] unless all of it is calls."""


class Llama3JsonParser(_CallsOrText):
    TAG, OPEN = "<|python_tag|>", "{"

    def parse(self, body: str) -> list[Call]:
        return _json_calls(body)


class MistralParser:
    MARK = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self.buf, self.calls_mode, self.started = "", False, False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buf += text
        if self.calls_mode:
            return "", []
        if not self.started:
            head = self.buf.lstrip()
            if not head or (len(head) < len(self.MARK) and self.MARK.startswith(head)):
                return "", []                            # not yet known: text, the mark, or the array
            self.started = True
            if head.startswith("[") and not head.startswith(self.MARK):
                self.calls_mode = True                   # the array itself, its control token dropped
                return "", []
        at = self.buf.find(self.MARK)
        if at >= 0:
            out, self.buf, self.calls_mode = self.buf[:at], self.buf[at:], True
            return out, []
        keep = _partial_tag(self.buf, self.MARK)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, []

    def end(self) -> tuple[str, list[Call]]:
        text, self.buf = self.buf, ""
        if not self.calls_mode:
            return text, []
        try:
            items = json.loads(text.strip().removeprefix(self.MARK))
        except ValueError:
            return text, []
        calls = [_as_call(i) for i in items] if isinstance(items, list) and items else [None]
        return ("", calls) if all(calls) else (text, [])


class PythonicParser(_CallsOrText):
    TAG, OPEN = "<|python_start|>", "["

    def parse(self, body: str) -> list[Call]:
        return _python_calls(body.removesuffix("<|python_end|>").strip())


def _opens(tag: str, text: str) -> bool:
    """Whether `text` may still become `tag` (a proper start of it)."""
    return len(text) < len(tag) and tag.startswith(text)


def _python_calls(text: str) -> list[Call]:
    """`[f(a=1), g()]` -> the calls; [] unless all of it is such a list (parsed, never evaluated)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg for k in node.keywords)):
            return []
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return []
    return calls


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


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
           "pythonic": PythonicParser}
