"""ZMQ client of the engine process, for frontends and Python programs.

`AsyncEngineClient` (asyncio) and `EngineClient` (blocking, runs its own loop on a thread) submit
requests, stream outputs, abort, and list / load / unload adapters, with the same msgspec messages the
engine speaks (ipc/). Every output of a request comes back only to the client that sent it.

Engine restarts lose nothing: the client remembers every request in flight and the tokens it has
received; when a new engine incarnation greets it, each request is sent again as its prompt plus those
tokens, asking only for the tokens still due, and its outputs carry on as one stream (usage counted
against the original prompt). A request is resent once: if the engine dies again while it runs (a
request that crashes the engine must not crash it forever), it fails with 503. Greedy requests continue
greedily from the tokens received; sampled ones continue from a fresh random state. A request made
while the engine is down waits for it to come back (up to RESTART_WAIT) instead of failing.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import msgspec
import zmq
import zmq.asyncio

from engine import metrics
from ipc.outputs import AdapterReply, EngineStatus, PoolReply, RateSyncReply, RequestOutput, decode_outputs
from ipc.pool_report import PoolReport
from ipc.requests import (
    AbortRequest,
    AdapterCommand,
    GenerateRequest,
    Hello,
    PoolQuery,
    RateLimit,
    RateSync,
    encode_request,
)
from ipc.sampling_params import SamplingParams

log = logging.getLogger("loraplex.client")
HEARTBEAT_TIMEOUT = 5.0
RESTART_WAIT = 180.0     # how long a request waits for a dead engine to come back before it fails
MAX_RESUBMITS = 1
MAX_BUFFERED = 1024      # outputs of one request waiting for its reader, beyond which the request is aborted


@dataclass
class _InFlight:
    request: GenerateRequest
    received: list[int] = field(default_factory=list)   # token ids this client has been sent
    carried: int = 0                                    # of those, how many the current engine got as prompt
    chars: int = 0                                      # characters of text this client has been sent
    resubmits: int = 0


class EngineError(RuntimeError):
    """A refusal or failure with its HTTP status; with a 429, `retry_after`: the seconds the engine asks for."""

    def __init__(self, message: str, status: int = 500, retry_after: float = 0.0):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class AsyncEngineClient:
    def __init__(self, address: str, client_id: str | None = None, max_buffered: int = MAX_BUFFERED):
        self.address = address
        self.max_buffered = max_buffered
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.status: EngineStatus | None = None
        self.last_heartbeat = 0.0
        self._queues: dict[str, asyncio.Queue] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._beat: asyncio.Task | None = None

    async def connect(self, timeout: float = 60.0) -> "AsyncEngineClient":
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.address)
        self._reader = asyncio.create_task(self._read())
        deadline = time.monotonic() + timeout
        try:
            while self.status is None:
                await self.sock.send(encode_request(Hello(self.client_id)))
                await asyncio.sleep(0.05)
                if time.monotonic() > deadline:
                    raise EngineError(f"engine at {self.address} did not answer within {timeout:.0f}s", 503)
        except BaseException:              # the timeout, or the caller cancelled: leave no task or socket behind
            await self.close()
            raise
        self._beat = asyncio.create_task(self._heartbeat())
        return self

    async def _heartbeat(self) -> None:
        """Tell the engine this client is alive; if it stops (the process died), the engine aborts its
        requests after a few seconds."""
        while True:
            await asyncio.sleep(1.0)
            await self.sock.send(encode_request(Hello(self.client_id)))

    async def close(self) -> None:
        """Abort every request still open on this client, then disconnect."""
        if self._queues:
            await self.sock.send(encode_request(AbortRequest(list(self._queues))))
        for task in (self._reader, self._beat):
            if task is not None:
                task.cancel()
        self.sock.close(0)
        self.ctx.term()

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self.last_heartbeat < HEARTBEAT_TIMEOUT

    async def until_healthy(self) -> None:
        """Return once the engine is heard from; while it is being restarted, wait for it, up to RESTART_WAIT
        after its last heartbeat (then 503)."""
        while not self.healthy:
            if time.monotonic() - self.last_heartbeat > RESTART_WAIT:
                raise EngineError("engine unavailable", 503)
            await asyncio.sleep(0.05)

    async def _read(self) -> None:
        while True:
            for msg in decode_outputs(await self.sock.recv()):
                if isinstance(msg, RequestOutput):
                    q = self._queues.get(msg.request_id)
                    if q is not None and q.qsize() >= self.max_buffered:
                        await self._overflowed(msg.request_id, q)
                    elif q is not None:
                        q.put_nowait(self._carry_on(msg))
                elif isinstance(msg, AdapterReply | PoolReply | RateSyncReply):
                    fut = self._replies.pop(msg.command_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, EngineStatus):
                    restarted = self.status is not None and msg.incarnation != self.status.incarnation
                    self.status = msg
                    self.last_heartbeat = time.monotonic()
                    if restarted:
                        await self._engine_restarted()

    async def _overflowed(self, rid: str, q: asyncio.Queue) -> None:
        """The request's reader fell max_buffered outputs behind: drop them, abort the request in the engine
        (its pages are freed) and end its stream with an error. Memory per request stays bounded."""
        del self._queues[rid]
        while not q.empty():
            q.get_nowait()
        q.put_nowait(RequestOutput(rid, finish_reason="abort", status=503, error=(
            f"aborted: the client fell {self.max_buffered} outputs behind (it stopped reading)")))
        await self.abort(rid)
        metrics.SLOW_READERS.labels("buffer").inc()
        log.warning("request %s aborted: its reader fell %d outputs behind", rid, self.max_buffered)

    def _carry_on(self, out: RequestOutput) -> RequestOutput:
        """Record what a request received; after a resubmission, count usage from the original prompt."""
        f = self._inflight.get(out.request_id)
        if f is None:
            return out
        f.received.extend(out.token_ids)
        f.chars += len(out.text)
        if f.carried and out.error is None:
            out = msgspec.structs.replace(
                out, prompt_tokens=len(f.request.prompt_token_ids) if out.prompt_tokens else 0,
                completion_tokens=out.completion_tokens + f.carried if out.completion_tokens else 0)
        return out

    async def _engine_restarted(self) -> None:
        """The engine process was replaced and the requests it held are gone: resend each (once) as its
        prompt plus the tokens already received; fail those resent before, and pending adapter commands."""
        for fut in self._replies.values():
            if not fut.done():
                fut.set_result(AdapterReply("", False, "the engine restarted"))
        for rid, f in list(self._inflight.items()):
            q = self._queues.get(rid)
            if q is None:
                continue
            req, params = f.request, f.request.params
            left = None if params.max_tokens is None else params.max_tokens - len(f.received)
            if f.resubmits >= MAX_RESUBMITS:
                q.put_nowait(RequestOutput(rid, finish_reason="abort", error="the engine restarted twice while "
                                           "this request ran", status=503))
            elif left is not None and left < 1:
                q.put_nowait(RequestOutput(rid, finish_reason="length"))
            else:
                f.resubmits += 1
                f.carried = len(f.received)
                # (prompt logprobs, when asked, came with the first output, so before any token)
                resent = msgspec.structs.replace(params, max_tokens=left,
                                                 min_tokens=max(0, params.min_tokens - len(f.received)),
                                                 prompt_logprobs=None if f.received else params.prompt_logprobs)
                again = GenerateRequest(rid, req.prompt_token_ids + f.received, resent, req.adapter,
                                    req.cache_salt, req.stream, resumed=len(f.received), resumed_chars=f.chars,
                                    tenant=req.tenant, max_waiting=req.max_waiting, adapters=req.adapters)
                await self.sock.send(encode_request(again))

    def new_request_id(self) -> str:
        return f"{self.client_id}-{next(self._ids)}"

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
                       cache_salt: str | None = None, stream: bool = True,
                       request_id: str | None = None, tenant: str = "",
                       max_waiting: int = 0, adapters: list[tuple[str, float]] | None = None,
                       rate: RateLimit | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (text deltas) until the one with finish_reason. tenant / max_waiting:
        who sent it and that tenant's own bound on its waiting requests, rate: its rate limits and this
        request's cost (see GenerateRequest). Closing the
        generator early (`contextlib.aclosing`, cancellation, a dropped HTTP client) or closing the client
        aborts the request in the engine. A request made while the engine restarts waits for it."""
        await self.until_healthy()
        rid = request_id or self.new_request_id()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        request = GenerateRequest(rid, prompt_token_ids, params, adapter, cache_salt, stream, tenant=tenant,
                                  max_waiting=max_waiting, adapters=adapters, rate=rate)
        self._inflight[rid] = _InFlight(request)
        finished = False
        try:
            await self.sock.send(encode_request(request))
            while not finished:
                try:
                    out = await asyncio.wait_for(q.get(), timeout=HEARTBEAT_TIMEOUT)
                except asyncio.TimeoutError:
                    if time.monotonic() - self.last_heartbeat > RESTART_WAIT:
                        finished = True     # nothing to abort: the engine is gone and did not come back
                        raise EngineError("engine unavailable", 503) from None
                    continue
                if out.error is not None:
                    finished = True
                    raise EngineError(out.error, out.status or 500, out.retry_after)
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(rid, None)
            self._inflight.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self.sock.send(encode_request(AbortRequest([request_id])))

    async def _adapter(self, op: str, name: str = "", path: str = "", pinned: bool = False) -> AdapterReply:
        cid = f"{self.client_id}-cmd-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._replies[cid] = fut
        await self.sock.send(encode_request(AdapterCommand(cid, op, name, path, pinned)))
        try:
            reply = await asyncio.wait_for(fut, timeout=300)
        finally:
            self._replies.pop(cid, None)
        if not reply.ok:
            raise EngineError(reply.error or "adapter command failed", 404 if op == "unload" else 400)
        return reply

    async def load_adapter(self, name: str, path: str = "", pinned: bool = False) -> list[str]:
        return (await self._adapter("load", name, path, pinned)).adapters

    async def unload_adapter(self, name: str) -> list[str]:
        return (await self._adapter("unload", name)).adapters

    async def list_adapters(self) -> list[str]:
        return (await self._adapter("list")).adapters

    async def pool_report(self) -> PoolReport:
        """The engine's pool and adapters now (ipc/pool_report.py), built between two of its steps."""
        return (await self._ask(PoolQuery(f"{self.client_id}-pool-{next(self._ids)}"), PoolReply)).report

    async def rate_sync(self, others: dict[str, dict[str, float]] | None) -> RateSyncReply:
        """Behind Ray Serve: give the engine the other replicas' rate-limit charges (None: none); -> its own."""
        return await self._ask(RateSync(f"{self.client_id}-rates-{next(self._ids)}", others), RateSyncReply)

    async def _ask(self, msg, want: type):
        """Send a query with a command_id and wait (30 s at most) for the engine's answer of type `want`."""
        fut = asyncio.get_running_loop().create_future()
        self._replies[msg.command_id] = fut
        await self.sock.send(encode_request(msg))
        try:
            reply = await asyncio.wait_for(fut, timeout=30)
        finally:
            self._replies.pop(msg.command_id, None)
        if not isinstance(reply, want):             # the engine restarted meanwhile
            raise EngineError(reply.error or "the engine did not answer", 503)
        return reply


class EngineClient:
    """Blocking facade over AsyncEngineClient, for scripts: its event loop runs on a daemon thread."""

    def __init__(self, address: str):
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="loraplex-client").start()
        self._client = AsyncEngineClient(address)
        self._call(self._client.connect())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
                 cache_salt: str | None = None) -> RequestOutput:
        """Run one request to the end; return its whole output."""
        async def run():
            text, ids, lps, last, prompt_lps = "", [], [], None, None
            async for out in self._client.generate(prompt_token_ids, params, adapter, cache_salt):
                text += out.text
                ids += out.token_ids
                lps += out.logprobs
                prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
                last = out
            return RequestOutput(last.request_id, ids, text, last.finish_reason, last.prompt_tokens,
                                 last.completion_tokens, last.cached_tokens, logprobs=lps, prompt_logprobs=prompt_lps)
        return self._call(run())

    def stream(self, prompt_token_ids: list[int], params: SamplingParams,
               adapter: str | None = None) -> Iterator[RequestOutput]:
        q: queue.Queue = queue.Queue()

        async def pump():
            try:
                async for out in self._client.generate(prompt_token_ids, params, adapter):
                    q.put(out)
            except Exception as e:  # noqa: BLE001 - handed to the caller's thread
                q.put(e)
            q.put(None)
        asyncio.run_coroutine_threadsafe(pump(), self._loop)
        while (item := q.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    def load_adapter(self, name: str, path: str = "", pinned: bool = False) -> list[str]:
        return self._call(self._client.load_adapter(name, path, pinned))

    def unload_adapter(self, name: str) -> list[str]:
        return self._call(self._client.unload_adapter(name))

    def list_adapters(self) -> list[str]:
        return self._call(self._client.list_adapters())

    @property
    def status(self) -> EngineStatus | None:
        return self._client.status

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
