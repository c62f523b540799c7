"""POST /v1/responses (OpenAI's Responses API, stateless: frontends/responses_api.py): the request becomes a
chat request and runs through the chat route's flow; the answer is a `Response` whose `output` holds the
assistant's message and its function calls, or, streamed, Responses events: `response.created`,
`response.in_progress`, each output item added, its text or arguments in deltas, each item done, and
`response.completed` (or `response.incomplete` when `max_output_tokens` cut it) with the whole response
and its usage. No `[DONE]` line, as OpenAI's."""
from __future__ import annotations

import time
import uuid

import msgspec

from frontends import api_requests
from frontends import api_responses as r
from frontends import responses_api as x
from frontends.api_error import ApiError
from frontends.chat_endpoint import ChatEndpoint
from frontends.echo import Plain
from frontends.tool_calls import ToolView, tool_plan

# chat fields an error may name -> the Responses fields they came from
FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


class ResponsesEndpoint(ChatEndpoint):
    id_prefix = "resp"

    async def __call__(self, request):
        try:
            return await super().__call__(request)
        except ApiError as e:                    # named as the client named it
            if e.param in FIELDS:
                e.message = e.message.replace(f"'{e.param}'", f"'{FIELDS[e.param]}'")
                e.param = FIELDS[e.param]
            raise

    async def read(self, request):
        raw = await api_requests.read(request, x.ResponsesRequest)
        try:
            chat = msgspec.convert(x.to_chat(raw), x.ResponsesChat)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"invalid request: {e}", None) from None
        return msgspec.structs.replace(chat, origin=raw)

    def new_id(self) -> str:
        return f"resp_{uuid.uuid4().hex}"

    def view(self, req, ids: list[int], echo: str | None, prompt_only: bool) -> Plain:
        plan = tool_plan(req, self.tool_parser)
        tools = ToolView(plan, self.format_logprobs, self.token_text) if plan else None
        return ResponsesView(req.origin, tools, self.format_logprobs, self.token_text)

    def answer(self, rid: str, model: str, choices: list[tuple], usage: r.Usage) -> x.Response:
        [(text, finish, _, view)] = choices
        return view.whole(rid, model, text, finish, usage)

    def chunk(self, rid, model, index, text, finish, first, logprobs, view):
        return view.events(rid, model, text, finish, first) or None

    def stream_tail(self, chunks, include_usage: bool) -> list[bytes]:
        return [self.sse_event(chunks.views[0].final(chunks.total_usage()))]

    def sse_event(self, body) -> bytes:
        kind = type(body).__struct_config__.tag or "error"
        return f"event: {kind}\n".encode() + b"data: " + msgspec.json.encode(body) + b"\n\n"


class ResponsesView(Plain):
    """The one choice of a Responses call: its answer whole (`whole`), or its stream's events (`events`,
    then `final`), from the chat flow's text; `tools` shows the text as a message and calls (ToolView)."""

    def __init__(self, origin: x.ResponsesRequest, tools: ToolView | None, format_logprobs, token_text):
        super().__init__(format_logprobs, token_text)
        self.origin, self.tools = origin, tools
        self.created = int(time.time())
        self.rid = self.model = ""
        self.seq = 0
        self.output: list[x.OutputItem] = []          # the stream's items so far, in order
        self.message: x.MessageItem | None = None     # the stream's message item while it is open
        self.calls: dict[int, x.FunctionCallItem] = {}  # tool call index -> its item
        self.finish: str | None = None

    # -- whole -----------------------------------------------------------------------------------------
    def whole(self, rid: str, model: str, text: str, finish: str | None, usage: r.Usage) -> x.Response:
        content, calls, finish = self._message(text, finish)
        status = "incomplete" if finish == "length" else "completed"
        output: list[x.OutputItem] = []
        if content:
            output.append(x.MessageItem(id=_item_id("msg"), status=status, role="assistant",
                                        content=[x.OutputText(type="output_text", text=content, annotations=[])]))
        output += [x.FunctionCallItem(id=_item_id("fc"), call_id=c.id, name=c.function.name,
                                      arguments=c.function.arguments, status="completed") for c in calls]
        return self._response(rid, model, status, output, usage)

    def _message(self, text: str, finish: str | None) -> tuple[str | None, list, str | None]:
        if self.tools is None:
            return text, [], finish
        message, finish = self.tools.message(text, finish)
        return message.content, message.tool_calls or [], finish

    # -- streamed --------------------------------------------------------------------------------------
    def events(self, rid: str, model: str, text: str, finish: str | None, first: bool) -> list:
        out = []
        if first:
            self.rid, self.model = rid, model
            begun = self._response(rid, model, "in_progress", [], None)
            out += [self._ev(x.ResponseCreated, response=begun), self._ev(x.ResponseInProgress, response=begun)]
        if self.tools is not None:
            delta, finish = self.tools.delta(text, finish, first)
            content, calls = delta.content, delta.tool_calls or []
        else:
            content, calls = text, []
        if content:
            out += self._text(content)
        for d in calls:
            out += self._call(d)
        if finish is not None:
            self.finish = finish
            out += self._close_message() + self._close_calls()
        return out

    def final(self, usage: r.Usage):
        status = "incomplete" if self.finish == "length" else "completed"
        done = self._response(self.rid, self.model, status, self.output, usage)
        return self._ev(x.ResponseIncomplete if status == "incomplete" else x.ResponseCompleted, response=done)

    def _text(self, piece: str) -> list:
        out = []
        if self.message is None:
            self.message = x.MessageItem(id=_item_id("msg"), status="in_progress", role="assistant",
                                         content=[])
            self.output.append(self.message)
            out += [self._ev(x.OutputItemAdded, output_index=len(self.output) - 1, item=_copy(self.message)),
                    self._ev(x.ContentPartAdded, item_id=self.message.id, output_index=len(self.output) - 1,
                             content_index=0, part=x.OutputText(type="output_text", text="", annotations=[]))]
            self.message.content.append(x.OutputText(type="output_text", text="", annotations=[]))
        self.message.content[0].text += piece
        return out + [self._ev(x.OutputTextDelta, item_id=self.message.id, output_index=self._index(self.message),
                               content_index=0, delta=piece, logprobs=[])]

    def _call(self, d: r.ToolCallDelta) -> list:
        item, out = self.calls.get(d.index), []
        if item is None:
            out += self._close_message()
            item = x.FunctionCallItem(id=_item_id("fc"), call_id=d.id or _item_id("call"),
                                      name=d.function.name or "", arguments="", status="in_progress")
            self.calls[d.index] = item
            self.output.append(item)
            out.append(self._ev(x.OutputItemAdded, output_index=len(self.output) - 1, item=_copy(item)))
        if d.function.arguments:
            item.arguments += d.function.arguments
            out.append(self._ev(x.ArgumentsDelta, item_id=item.id, output_index=self._index(item),
                                delta=d.function.arguments))
        return out

    def _close_message(self) -> list:
        m, self.message = self.message, None
        if m is None:
            return []
        m.status = "incomplete" if self.finish == "length" else "completed"
        at, part = self._index(m), m.content[0]
        return [self._ev(x.OutputTextDone, item_id=m.id, output_index=at, content_index=0, text=part.text,
                         logprobs=[]),
                self._ev(x.ContentPartDone, item_id=m.id, output_index=at, content_index=0, part=_copy(part)),
                self._ev(x.OutputItemDone, output_index=at, item=_copy(m))]

    def _close_calls(self) -> list:
        out = []
        for item in self.calls.values():
            item.status = "completed"
            out += [self._ev(x.ArgumentsDone, item_id=item.id, output_index=self._index(item),
                             arguments=item.arguments),
                    self._ev(x.OutputItemDone, output_index=self._index(item), item=_copy(item))]
        self.calls = {}
        return out

    def _index(self, item) -> int:
        return next(i for i, o in enumerate(self.output) if o is item)

    def _ev(self, kind, **fields):
        event = kind(sequence_number=self.seq, **fields)
        self.seq += 1
        return event

    # -- the response object -----------------------------------------------------------------------------
    def _response(self, rid: str, model: str, status: str, output: list, usage: r.Usage | None) -> x.Response:
        o = self.origin
        tools = [{k: v for k, v in msgspec.to_builtins(t).items()} for t in o.tools or []]
        choice = o.tool_choice if isinstance(o.tool_choice, str) else \
            msgspec.to_builtins(o.tool_choice) if o.tool_choice is not None else ("auto" if tools else "none")
        text = msgspec.to_builtins(o.text) if o.text is not None and o.text.format is not None else \
            {"format": {"type": "text"}}
        return x.Response(
            id=rid, object="response", created_at=self.created, status=status, model=model,
            output=[_copy(i) for i in output], usage=_usage(usage) if usage is not None else None,
            incomplete_details=x.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=None, instructions=o.instructions, max_output_tokens=o.max_output_tokens,
            temperature=1.0 if o.temperature is None else o.temperature, top_p=1.0 if o.top_p is None else o.top_p,
            tools=tools, tool_choice=choice, parallel_tool_calls=o.parallel_tool_calls is not False, text=text,
            metadata=o.metadata or {}, store=False, previous_response_id=None)


def _usage(u: r.Usage) -> x.ResponseUsage:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return x.ResponseUsage(input_tokens=u.prompt_tokens,
                           input_tokens_details=x.InputTokensDetails(cached_tokens=cached),
                           output_tokens=u.completion_tokens,
                           output_tokens_details=x.OutputTokensDetails(reasoning_tokens=0),
                           total_tokens=u.total_tokens)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _copy(struct):
    """A snapshot (events carry an item as it is then; the stream's items keep changing)."""
    return msgspec.convert(msgspec.to_builtins(struct), type(struct))
