"""One generation route of OpenAI's API, the flow both share: read the typed body, tokenize the prompt (or
each prompt of a completions batch), check it, send its `n` choices to the engine (choice p * n + i: prompt
p's i-th), and answer whole or as server-sent events.
`CompletionsEndpoint` and `ChatEndpoint` say what differs: the request type, the prompt, the logprobs'
shape and the answer and chunk structs (api_responses), which is what goes on the wire."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from typing import ClassVar

import msgspec
from aiohttp import web

from engine import metrics
from frontends import api_requests, request_fields, sse
from frontends.api_error import ApiError
from frontends.api_requests import Generation
from frontends.api_responses import Usage, encode
from frontends.choices import Merged, choice_params, choices_usage, collect
from frontends.echo import Plain
from frontends.engine_client import AsyncEngineClient, EngineError
from frontends.error_middleware import no_such_model
from frontends.request_id import traced
from frontends.request_log import note
from frontends.stream_chunks import StreamChunks, finish_reason
from ipc.sampling_params import SamplingParams

log = logging.getLogger("loraplex.http")


class GenerationEndpoint(ABC):
    """An aiohttp handler (`await endpoint(request)`) for one generation route."""
    request_type: ClassVar[type[Generation]]
    id_prefix: ClassVar[str]                      # of the answer's id: "cmpl", "chatcmpl"
    prompt_field: ClassVar[str]                   # the request field a length error names
    default_max_tokens: ClassVar[int | None]      # without max_tokens (None: up to the context)
    refused: ClassVar[dict[str, tuple]]           # unsupported fields -> the values meaning off

    def __init__(self, client: AsyncEngineClient, tokenizer, labels: metrics.AdapterLabels, stream_timeout: float):
        self.client, self.tokenizer, self.labels, self.stream_timeout = client, tokenizer, labels, stream_timeout

    # -- what differs ----------------------------------------------------------------------------------
    @abstractmethod
    def prompts(self, req) -> list[tuple[list[int], str | None]]:
        """Per prompt (one; completions take a batch): its token ids, and the text to echo before the answer
        (None: no echo)."""

    @abstractmethod
    def logprobs_count(self, req) -> int | None:
        """Alternatives per token to report (0: the token's own logprob only), or None for no logprobs."""

    @abstractmethod
    def format_logprobs(self, entries: list, offset: int):
        """A choice's logprobs object for these tokens; offset: characters of its text before them."""

    @abstractmethod
    def answer(self, rid: str, model: str, choices: list[tuple], usage: Usage):
        """The whole answer; choices: (text, finish_reason, logprobs or None, view) per choice, in index
        order (view: the choice's `view`)."""

    @abstractmethod
    def chunk(self, rid: str, model: str, index: int, text: str, finish: str | None, first: bool, logprobs, view):
        """One event of a streamed answer: what choice `index` adds (first: its first event; view: the
        choice's `view`, which may hold state across its events); None: nothing to send yet."""

    @abstractmethod
    def usage_chunk(self, rid: str, model: str, usage: Usage):
        """The last event of a stream with `stream_options.include_usage`: no choices, the usage."""

    def view(self, req, ids: list[int], echo: str | None, prompt_only: bool) -> Plain:
        """How one choice's text and logprobs are shown (completions override it for echo, chat for tools);
        one object per choice."""
        return Plain(self.format_logprobs, self.token_text)

    def constraint(self, req):
        """An output constraint the route itself sets (chat: a tool call's schema), or None."""
        return None

    async def read(self, request: web.Request):
        """The typed request (the Responses route makes a chat request of its own)."""
        return await api_requests.read(request, self.request_type)

    def new_id(self) -> str:
        """The answer's id."""
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def sse_event(self, body) -> bytes:
        """One server-sent event of a streamed answer."""
        return sse.event(body)

    def stream_tail(self, chunks: StreamChunks, include_usage: bool) -> list[bytes]:
        """What a stream ends with once every choice finished: the usage chunk if asked for, `[DONE]`."""
        return ([self.sse_event(chunks.usage())] if include_usage else []) + [sse.DONE]

    # -- the flow ---------------------------------------------------------------------------------------
    async def __call__(self, request: web.Request) -> web.StreamResponse:
        req = await self.read(request)
        prompts = self.prompts(req)
        adapter = self.adapter_for(request, req.model)
        members = self.composition(request, req, adapter)
        if members:
            adapter = "+".join(n for n, _ in members)      # its label in metrics and logs
        params, prompt_only = self.sampling(req, prompts)
        caller = request["caller"]
        n, stream, tenant = req.n or 1, bool(req.stream), caller.tenant
        total = len(prompts) * n
        request_fields.check_choices(tenant, len(prompts), n)
        views = [self.view(req, *prompts[k // n], prompt_only) for k in range(total)]   # choice k: prompt k // n's
        salt = caller.cache_salt(req.cache_salt)
        await self.client.until_healthy()    # a bad request is answered at once, also while the engine restarts
        rid = self.new_id()
        note(request, id=rid)
        limit = self.client.status.max_model_len
        rate = tenant.rate([len(ids) for ids, _ in prompts], params.max_tokens, n, limit) if tenant else None
        gens = Merged([self.client.generate(prompts[k // n][0], choice_params(params, k % n),
                                            None if members else adapter, salt, stream=stream,
                                            request_id=rid if total == 1 else f"{rid}-{k}",
                                            tenant="" if tenant is None else tenant.name,
                                            max_waiting=(tenant.max_waiting or 0) if tenant else 0,
                                            adapters=members, rate=rate if k == 0 else None)   # the whole cost
                       for k in range(total)])
        try:
            if stream:
                usage = bool(req.stream_options and req.stream_options.include_usage)
                return await self.stream(request, gens, rid, req.model, usage, adapter, views, n)
            return await self.whole(request, gens, rid, req.model, adapter, views, n, params.logprobs is not None)
        except EngineError as e:         # a constraint the engine could not compile: named as the client sent it
            field = request_fields.constraint_field(req, self.constraint(req))
            if field is None or e.status != 400 or not str(e).startswith("structured_outputs"):
                raise
            raise ApiError(400, f"'{field}': {str(e).partition(': ')[2] or e}", field) from None

    def sampling(self, req, prompts: list[tuple[list[int], str | None]]) -> tuple[SamplingParams, bool]:
        """The request's sampling parameters, once each prompt fits the context and no unsupported field is
        asked for; and whether only the prompts are asked for (echo with max_tokens 0)."""
        echo = prompts[0][1] is not None
        for p, (ids, _) in enumerate(prompts):
            with request_fields.batch_member(p, len(prompts)):
                prompt_only = request_fields.check_length(req, len(ids), self.client.status.max_model_len,
                                                          self.prompt_field, echo)
        request_fields.refuse_unsupported(req, self.refused)
        params = request_fields.sampling_params(req, self.logprobs_count(req), self.default_max_tokens, prompt_only,
                                                self.constraint(req))
        if echo and params.logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=params.logprobs)
        return params, prompt_only

    def adapter_for(self, request: web.Request, model: str) -> str | None:
        """The adapter `model` names (None: the base model), if the caller may use it; the same 404 as for
        a model that does not exist otherwise."""
        request["model"] = model
        adapter = None if model == self.client.status.model else model
        if not request["caller"].may_use(adapter):
            raise ApiError(404, no_such_model(model), "model", "model_not_found")
        return adapter

    def composition(self, request: web.Request, req, adapter: str | None) -> list[tuple[str, float]] | None:
        """`adapters` as (name, scale) pairs, `model`'s adapter first with scale 1.0; each one the caller may
        use (the same 404 as for a model that does not exist otherwise). The engine checks the rest."""
        if not req.adapters:
            return None
        members = ([(adapter, 1.0)] if adapter is not None else []) + [(a.name, a.scale) for a in req.adapters]
        for name, _ in members:
            if not request["caller"].may_use(name) or name == self.client.status.model:
                raise ApiError(404, no_such_model(name), "adapters", "model_not_found")
        return members

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def whole(self, request, gens: Merged, rid: str, model: str, adapter, views: list[Plain], n: int,
                    logprobs: bool) -> web.Response:
        """The non-streamed answer, once every choice has finished; views[k]: how choice k is shown, n: the
        choices of each prompt."""
        start = time.monotonic()
        done = await collect(gens, lambda out: self.observe(adapter, out.finish_reason, start))
        use = choices_usage([c.final for c in done], n, views[0].prompt_only)
        choices = [(view.text(c.text, True), finish_reason(c.final.finish_reason),
                    view.logprobs(c.entries, c.prompt_logprobs, 0, True) if logprobs else None, view)
                   for c, view in zip(done, views)]
        resp = web.Response(body=encode(self.answer(rid, model, choices, use)), content_type="application/json")
        await resp.prepare(request)
        await resp.write_eof()
        self.delivered(request, [c.final.finish_reason for c in done], use)
        return resp

    async def stream(self, request, gens: Merged, rid: str, model: str, include_usage: bool, adapter,
                     views: list[Plain], n: int) -> web.StreamResponse:
        """Server-sent events: each output of choice i becomes a chunk with index i; usage (summed over
        the choices) and [DONE] after the last choice finishes."""
        start = time.monotonic()
        # the first output decides the status: an engine error before any token is a plain JSON error
        try:
            i, out = await gens.__anext__()
        except BaseException:
            await gens.aclose()
            raise
        resp = await sse.open_stream(request)
        chunks, last_t, finishes = StreamChunks(rid, model, self, views, n), None, []
        try:
            while True:
                now = time.monotonic()
                if last_t is None:
                    metrics.TTFT.observe(now - start)
                    note(request, ttft_s=round(now - start, 4))
                else:
                    metrics.ITL.observe(now - last_t)
                last_t = now
                chunk = chunks.chunk(i, out)
                for body in chunk if isinstance(chunk, list) else [] if chunk is None else [chunk]:
                    await self.send(resp, self.sse_event(body))
                if out.finish_reason is not None:
                    self.observe(adapter, out.finish_reason, start)
                    finishes.append(out.finish_reason)
                    if chunks.finish(i, out):
                        break
                i, out = await gens.__anext__()
            for data in self.stream_tail(chunks, include_usage):
                await self.send(resp, data)
            self.delivered(request, finishes, chunks.total_usage())
        except EngineError as e:
            note(request, outcome="engine_error", error=str(e))
            try:
                await self.send(resp, sse.event(ApiError(e.status, str(e)).response()))
            except (sse.SlowReader, ConnectionError):
                sse.hang_up(request)
        except sse.SlowReader:
            note(request, outcome="slow_reader")
            metrics.SLOW_READERS.labels("timeout").inc()
            log.warning("client of %s read nothing for %.0f s; aborting it", traced(request, rid), self.stream_timeout)
            sse.hang_up(request)
        except asyncio.CancelledError:
            log.info("client of %s went away; aborting it", traced(request, rid))
            raise
        except ConnectionError:      # a write found the connection lost or closing: nothing left to answer
            note(request, outcome="client_gone")
            log.info("client of %s went away; aborting it", traced(request, rid))
            sse.hang_up(request)
        finally:
            await gens.aclose()          # aborts the requests in the engine that are still running
        return resp

    async def send(self, resp: web.StreamResponse, data: bytes) -> None:
        await sse.send(resp, data, self.stream_timeout)

    def observe(self, adapter: str | None, finish: str | None, start: float) -> None:
        metrics.E2E.observe(time.monotonic() - start)
        metrics.REQUESTS.labels(self.labels(adapter), finish or "none").inc()

    @staticmethod
    def delivered(request: web.Request, finishes: list, usage: Usage) -> None:
        """The whole answer (every choice) was written to the client: what its tenant's counters count, and
        the request log's token counts (frontends/request_log.py)."""
        tenant = request["caller"].name
        for finish in finishes:
            metrics.TENANT_REQUESTS.labels(tenant, finish or "none").inc()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        for kind, n in (("prompt", usage.prompt_tokens), ("completion", usage.completion_tokens), ("cached", cached)):
            metrics.TENANT_TOKENS.labels(tenant, kind).inc(n)
        note(request, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
             cached_tokens=cached, finish_reasons=[finish_reason(f) for f in finishes])
