"""Tool calling in /v1/chat/completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

`tool_plan(req, parser)` reads the request; the tools always reach the chat template (its `tools`
variable). Per `tool_choice`:
- "none": text only;
- a named function: the output is constrained to that function's `parameters` schema and answered as one
  call of it (finish_reason "stop", as OpenAI's);
- "required": constrained to a JSON array of `{"name", "parameters"}` objects over the tools (at most one
  with `parallel_tool_calls` false), answered as those calls (finish_reason "tool_calls");
- "auto" (the default with tools): the model writes text, calls or both in its own format, which the
  server's --tool-call-parser (frontends/tool_parsers.py) separates; without one, a 400 says so.
The constraints are the engine's structured outputs (JSON schemas compiled by xgrammar), so a call always
parses and follows the schema, unless max_tokens cut it short: then the text comes back as content, with
finish_reason "length".

`ToolView` shows one choice: whole (`message`) or streamed (`delta`, OpenAI's tool-call deltas: a call's
id and name on its first piece, then pieces of its arguments).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from frontends import api_responses as r
from frontends.api_error import ApiError
from frontends.echo import Plain
from frontends.tool_parsers import PARSERS, Call
from ipc.sampling_params import StructuredOutputsParams

AUTO_NEEDS_PARSER = ("tool_choice 'auto' (the default when 'tools' are given) needs a server started with "
                     "--tool-call-parser ({}); this one has none: send tool_choice 'required', 'none' or a "
                     "named function")


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                   # "none", "auto", "required" or "named"
    tools: list[dict]                           # OpenAI's tool definitions, for the chat template
    constraint: StructuredOutputsParams | None = None
    name: str = ""                              # the named function
    parser: str = ""                            # auto: the --tool-call-parser
    parallel: bool = True


def tool_plan(req, parser: str | None) -> ToolPlan | None:
    """The request's tool plan; None without tools (and a tool_choice of none or absent). 400 naming the
    field for a choice that cannot be honoured."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools': this request defines no tool", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ApiError(400, f"'tools': function {dup!r} is defined twice", "tools")
    defs = [_definition(t.function) for t in tools]
    parallel = req.parallel_tool_calls is not False
    base = dict(tools=defs, parallel=parallel)
    if choice is None or choice == "auto":
        if not parser:
            raise ApiError(400, AUTO_NEEDS_PARSER.format(" or ".join(PARSERS)), "tool_choice")
        return ToolPlan("auto", parser=parser, **base)
    if choice == "none":
        return ToolPlan("none", **base)
    if choice == "required":
        return ToolPlan("required", constraint=StructuredOutputsParams(json=_calls_schema(defs, parallel)), **base)
    if choice.function.name not in names:
        raise ApiError(400, f"'tool_choice' names function {choice.function.name!r}, which 'tools' does not "
                       f"define (it defines {', '.join(map(repr, names))})", "tool_choice")
    schema = _parameters(defs[names.index(choice.function.name)])
    return ToolPlan("named", constraint=StructuredOutputsParams(json=schema), name=choice.function.name, **base)


def _definition(fn) -> dict:
    out = {"name": fn.name}
    if fn.description is not None:
        out["description"] = fn.description
    out["parameters"] = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def _parameters(definition: dict) -> dict:
    return definition["function"]["parameters"]


def _calls_schema(defs: list[dict], parallel: bool) -> dict:
    """A JSON array of one or more calls, each `{"name": one of the tools, "parameters": its arguments}`."""
    one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [d["function"]["name"]]},
                                             "parameters": _parameters(d)},
            "required": ["name", "parameters"]} for d in defs]
    schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _required_calls(text: str) -> list[Call] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                              for i in items):
        return None
    return [(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


class ToolView(Plain):
    """One choice's text as an assistant message under a tool plan. Streamed pieces must be given in
    order, each once; `message` takes the whole text of a choice that was not streamed."""

    def __init__(self, plan: ToolPlan, format_logprobs, token_text):
        super().__init__(format_logprobs, token_text)
        self.plan = plan
        self.parser = PARSERS[plan.parser]() if plan.mode == "auto" else None
        self.held = ""                   # required: the array, shown when it is complete
        self.calls = 0                   # calls sent so far (the next call's index)
        self.named_id = _call_id()

    # -- whole -----------------------------------------------------------------------------------------
    def message(self, text: str, finish: str | None) -> tuple[r.AssistantMessage, str | None]:
        mode = self.plan.mode
        if mode == "none":
            return r.AssistantMessage(role="assistant", content=text), finish
        if mode == "named":
            if finish == "length" or not _is_json(text):
                return r.AssistantMessage(role="assistant", content=text), finish
            return self._answer(None, [(self.plan.name, text.strip())]), finish
        if mode == "required":
            calls = _required_calls(text) if finish != "length" else None
            if not calls:
                return r.AssistantMessage(role="assistant", content=text), finish
            return self._answer(None, calls), "tool_calls"
        content, calls = self.parser.feed(text)
        rest, more = self.parser.end()
        content, calls = (content + rest).strip() or None, self._allowed(calls + more)
        if not calls:
            return r.AssistantMessage(role="assistant", content=text), finish
        return self._answer(content, calls), "tool_calls" if finish == "stop" else finish

    @staticmethod
    def _answer(content: str | None, calls: list[Call]) -> r.AssistantMessage:
        return r.AssistantMessage(role="assistant", content=content, tool_calls=[
            r.ToolCall(id=_call_id(), type="function", function=r.FunctionCall(name=n, arguments=a))
            for n, a in calls])

    # -- streamed --------------------------------------------------------------------------------------
    def delta(self, text: str, finish: str | None, first: bool) -> tuple[r.Delta, str | None]:
        """What this piece of the choice's text adds (the role on the first), and the finish reason to show."""
        role = "assistant" if first else None
        mode = self.plan.mode
        if mode == "none":
            return r.Delta(role=role, content=text), finish
        if mode == "named":
            fn = r.FunctionCallDelta(name=self.plan.name if first else None, arguments=text)
            call = r.ToolCallDelta(index=0, id=self.named_id if first else None, type="function" if first else None,
                                   function=fn)
            return r.Delta(role=role, tool_calls=[call] if first or text else None), finish
        if mode == "required":
            self.held += text
            if finish is None:
                return r.Delta(role=role), None
            calls = _required_calls(self.held) if finish != "length" else None
            if not calls:
                return r.Delta(role=role, content=self.held), finish
            return r.Delta(role=role, tool_calls=self._deltas(calls)), "tool_calls"
        content, calls = self.parser.feed(text)
        if finish is not None:
            rest, more = self.parser.end()
            content, calls = content + rest, calls + more
        calls = self._allowed(calls)
        deltas = self._deltas(calls) if calls else None
        shown = "tool_calls" if finish == "stop" and self.calls else finish
        return r.Delta(role=role, content=content or None, tool_calls=deltas), shown

    def _allowed(self, calls: list[Call]) -> list[Call]:
        """With parallel_tool_calls false, the model's first call only."""
        return calls if self.plan.parallel else calls[:max(0, 1 - self.calls)]

    def _deltas(self, calls: list[Call]) -> list[r.ToolCallDelta]:
        out = []
        for name, args in calls:
            out.append(r.ToolCallDelta(index=self.calls, id=_call_id(), type="function",
                                       function=r.FunctionCallDelta(name=name, arguments=args)))
            self.calls += 1
        return out
