"""The engine process: one uvloop event loop whose actors exchange msgspec messages over queues.

Actors (asyncio tasks):
  receive   ZMQ ROUTER <- every frontend: requests, aborts, adapter commands      -> inbox
  step      applies the inbox between steps, then runs one step and its detokenization
            (OutputProcessor.step, the offline LLM's loop body too) in the engine thread  -> send queue
  send      -> ZMQ ROUTER: each output only to the frontend that asked; heartbeats to all
  heartbeat drops silent frontends (aborting their requests) and sends the status every second
The forward pass, every torch op and the detokenizer run on one dedicated engine thread, so the loop keeps
receiving and sending while a step computes. Bad input is answered with an error output; the engine keeps serving.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq
import zmq.asyncio

from engine import envs, metrics
from engine.config import EngineConfig
from engine.core.engine_core import DeviceFault, EngineCore, freeze_startup_objects
from engine.core.warm_up import warm_up
from engine.lora.compose import check_members
from engine.output_processor import OutputProcessor
from engine.serving.adapter_commands import AdapterCommands
from engine.serving.adapter_fetches import AdapterFetches
from engine.serving.adapter_journal import AdapterJournal
from engine.serving.adapter_source import AdapterSource, hub_url
from engine.serving.engine_stats import EngineStatsPublisher
from engine.serving.grammar_compiles import GrammarCompiles
from engine.serving.pool_view import PoolView
from engine.serving.rate_limits import RateLimits, RateRefusal
from engine.serving.request_routes import RequestRoutes
from ipc.outputs import EngineStatus, PoolReply, RateSyncReply, RequestOutput, encode_outputs
from ipc.requests import AbortRequest, AdapterCommand, GenerateRequest, Hello, PoolQuery, RateSync, decode_request

log = logging.getLogger("loraplex.engine")
FRONTEND_TIMEOUT = 5.0


class AsyncEngine:
    def __init__(self, engine_kwargs: dict, address: str, adapter_dir: str | None, state_file: str | None = None,
                 lora_roots: list[str] | None = None, runtime_lora: bool = True, max_waiting: int = 1024,
                 adapter_source: str | None = None):
        self.kwargs = engine_kwargs
        self.source = None
        if adapter_source:
            hub = adapter_source.startswith("hf://")
            url = hub_url(adapter_source, envs.hf_endpoint()) if hub else adapter_source
            self.source = AdapterSource(url, envs.adapter_cache_dir(url), envs.adapter_source_token(hub))
        self.address = address
        self.adapter_dir = adapter_dir
        # where /v1/load_lora_adapter may load from, and whether it may at all
        self.lora_roots = ([adapter_dir] if adapter_dir else []) + list(lora_roots or [])
        self.runtime_lora = runtime_lora
        self.journal = AdapterJournal(state_file) if state_file else None
        self.max_waiting = max_waiting            # requests waiting beyond it are refused at once (429)
        self.rates = RateLimits()                 # tenants' requests_per_minute / tokens_per_minute (429)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="loraplex-engine")
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.send_q: asyncio.Queue = asyncio.Queue()
        self.routes = RequestRoutes()
        self.frontends: dict[bytes, float] = {}   # identity -> last time it said Hello
        self.wakeup = asyncio.Event()
        self.incarnation = uuid.uuid4().hex
        self.draining = False       # drain(): new requests get a 503; serve() returns once none is left

    # -- set-up -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        from engine.tokenizer import load_tokenizer

        def build():
            cfg = EngineConfig.create(**self.kwargs)
            return EngineCore(cfg), load_tokenizer(cfg.model.path)
        self.core, tok = await self._run(build)
        self.processor = OutputProcessor(tok)
        self.compiles = GrammarCompiles(self.core.grammars, self._requeue, self.refuse)
        self.adapter_ops = AdapterCommands(self.core, self._run, self.broadcast_status, self.adapter_dir,
                                           self.lora_roots, self.runtime_lora, self.journal, self.source)
        self.fetches = AdapterFetches(self.source, self.adapter_ops.knows, self._requeue, self.refuse) \
            if self.source else None
        catalog = self.adapter_ops.catalog
        self.stats = EngineStatsPublisher(self.core, listed=lambda: len(catalog.listed) if catalog else 0)
        self.pool_view = PoolView(self.core, listed=lambda: set(catalog.listed) if catalog else set())
        if self.adapter_ops.catalog is not None:
            log.info("%d adapters listed in %s (each read when first used)", len(self.adapter_ops.catalog.listed),
                     self.adapter_dir)
        await self.adapter_ops.restore()
        if self.core.runner.device.type == "cuda":
            await self._run(warm_up, self.core)         # every Triton kernel compiled before we say ready
        freeze_startup_objects()            # this engine lives as long as this process
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.bind(self.address)

    def _requeue(self, identity: bytes, req: GenerateRequest) -> None:
        """A request back in the inbox (its constraint compiled), applied before the next step."""
        self.inbox.put_nowait((identity, req))
        self.wakeup.set()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    async def serve(self) -> None:
        await self.start()
        print(json.dumps({"ready": True, "model": self.core.cfg.model.name}), flush=True)
        tasks = [asyncio.create_task(c) for c in (self.receive(), self.step_loop(), self.send(), self.heartbeat())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()              # an actor's exception ends the engine, as before
        finally:
            for t in tasks:
                t.cancel()
            self.compiles.close()                   # the compile worker, if one was started
            if self.source is not None:
                await self.source.close()
            self.sock.close(linger=2000)

    def drain(self) -> None:
        """Stop taking requests (each new one gets a 503) and return from serve() once every request
        admitted has finished and its last output was sent."""
        self.draining = True
        self.wakeup.set()

    # -- actors -----------------------------------------------------------------------------------------
    async def receive(self) -> None:
        while True:
            identity, data = await self.sock.recv_multipart()
            try:
                msg = decode_request(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("dropping malformed message from %r: %s", identity, e)
                continue
            if isinstance(msg, Hello):
                if identity not in self.frontends:
                    await self.send_q.put((identity, self.status()))
                self.frontends[identity] = time.monotonic()
                continue
            await self.inbox.put((identity, msg))
            self.wakeup.set()

    async def step_loop(self) -> None:
        while True:
            while not self.inbox.empty():
                identity, msg = self.inbox.get_nowait()
                await self.apply(identity, msg)
            if not self.core.has_unfinished():
                if self.draining and not self.compiles.waiting and not (self.fetches and self.fetches.waiting):
                    await self.send_q.join()            # the last outputs are out
                    return
                await self._run(self.core.settle)
                self.stats.publish(force=True)
                self.wakeup.clear()
                if self.inbox.empty():
                    await self.wakeup.wait()
                continue
            try:
                deltas = await self._run(self.processor.step, self.core)
            except DeviceFault:
                raise                           # the process exits; the launcher starts a new engine
            except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
                log.exception("engine step failed; failing the running requests")
                await self.fail_running(f"internal error in the engine step: {e}")
                continue
            await self.deliver(deltas)
            self.stats.publish()

    async def send(self) -> None:
        while True:
            identity, msg = await self.send_q.get()
            batch, n = [msg], 1
            while not self.send_q.empty() and n < 256:
                nxt_identity, nxt = self.send_q.get_nowait()
                n += 1
                if nxt_identity != identity:
                    await self._send(identity, batch)
                    identity, batch = nxt_identity, []
                batch.append(nxt)
            await self._send(identity, batch)
            for _ in range(n):
                self.send_q.task_done()

    async def _send(self, identity: bytes, batch: list) -> None:
        try:
            await self.sock.send_multipart([identity, encode_outputs(batch)])
        except zmq.ZMQError as e:
            log.warning("could not send to frontend %r: %s", identity, e)

    async def heartbeat(self) -> None:
        while True:
            self.drop_silent_frontends()
            self.pool_view.sample()
            await self.broadcast_status()
            await asyncio.sleep(1.0)

    def drop_silent_frontends(self) -> None:
        """A frontend silent for FRONTEND_TIMEOUT seconds is gone (e.g. killed): abort its requests."""
        now = time.monotonic()
        for identity, seen in list(self.frontends.items()):
            if now - seen > FRONTEND_TIMEOUT:
                del self.frontends[identity]
                orphans = self.routes.owned_by(identity)
                self.inbox.put_nowait((identity, AbortRequest(orphans)))
                self.wakeup.set()
                log.warning("frontend %r went silent; aborting its %d requests", identity, len(orphans))

    def status(self) -> EngineStatus:
        s = self.core.scheduler
        m = self.core.cfg.model
        names = self.adapter_ops.names()
        return EngineStatus(m.name, m.path, m.max_model_len, names, len(s.running), len(s.waiting),
                            self.incarnation, m.vocab_size, [self.adapter_ops.digest(n) for n in names])

    # -- inputs -----------------------------------------------------------------------------------------
    async def apply(self, identity: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            await self.add(identity, msg)
        elif isinstance(msg, AbortRequest):
            for rid in msg.request_ids:
                if self.routes.owner.get(rid) == identity:
                    self.core.abort(rid)
                    self.forget(rid)
                else:
                    self.compiles.abort(rid, identity)
                    if self.fetches is not None:
                        self.fetches.abort(rid, identity)
        elif isinstance(msg, AdapterCommand):
            if self.fetches is not None and self.fetches.holds_command(identity, msg):
                return                              # back in the inbox once the store answered
            await self.send_q.put((identity, await self.adapter_ops.handle(msg)))
        elif isinstance(msg, PoolQuery):      # built between two steps: the engine thread runs one thing at a time
            await self.send_q.put((identity, PoolReply(msg.command_id, await self._run(self.pool_view.report))))
        elif isinstance(msg, RateSync):       # behind Ray Serve: the replicas share their tenants' charges
            if msg.others is not None:
                self.rates.absorb(msg.others)
            await self.send_q.put((identity, RateSyncReply(msg.command_id, self.incarnation,
                                                           self.rates.charged_table())))

    def over_limit(self, req: GenerateRequest) -> str | None:
        """Why `req` cannot join the waiting queue now (the global or its tenant's bound), or None. Requests
        held for a compile or a fetch count as waiting."""
        waiting = self.core.scheduler.waiting
        held = [h for h in (self.compiles, self.fetches) if h is not None]
        count = len(waiting) + sum(h.count() for h in held)
        if count >= self.max_waiting:
            return f"the server has {count} requests waiting (--max-waiting {self.max_waiting}); retry later"
        if req.max_waiting and req.tenant:
            mine = sum(1 for r in waiting if r.tenant == req.tenant) + sum(h.count(req.tenant) for h in held)
            if mine >= req.max_waiting:
                return f"tenant {req.tenant!r} has {mine} requests waiting (its max_waiting); retry later"
        return None

    async def add(self, identity: bytes, req: GenerateRequest) -> None:
        if self.draining:
            return await self.refuse(identity, req.request_id, "the server is shutting down", 503)
        full = None if req.resumed else self.over_limit(req)     # a resent request keeps its place
        if full is not None:
            return await self.refuse(identity, req.request_id, full, 429)
        if self.compiles.holds(identity, req):
            return                                  # back in the inbox once its constraint is compiled
        if self.fetches is not None and self.fetches.holds(identity, req):
            return                                  # back in the inbox once its adapters arrived
        rate = None if req.resumed else req.rate                  # and was charged before
        try:
            self.rates.check(req.tenant, rate)
        except RateRefusal as e:
            metrics.RATE_LIMITED.labels(req.tenant, e.limit).inc()
            return await self.refuse(identity, req.request_id, str(e), e.status, e.retry_after)
        try:
            if req.adapters:                        # its count and scales before any folder is read
                check_members(req.adapters, self.core.cfg.lora.max_adapters_per_request)
            for name in [req.adapter] + [n for n, _ in req.adapters or ()]:
                await self.adapter_ops.load_on_demand(name)
            self.core.add_request(req)
        except LookupError as e:
            return await self.refuse(identity, req.request_id, str(e.args[0]) if e.args else str(e), 404)
        except ValueError as e:
            return await self.refuse(identity, req.request_id, str(e), 400)
        self.rates.charge(req.tenant, rate)
        for name in [req.adapter] + [n for n, _ in req.adapters or ()]:
            self.pool_view.note_request(name)
        self.routes.add(req.request_id, identity, req.stream)
        self.processor.add(req.request_id, req.prompt_token_ids, req.params.stop,
                           req.params.include_stop_str_in_output, req.resumed, req.resumed_chars)

    async def refuse(self, identity: bytes, request_id: str, error: str, status: int, retry_after: float = 0.0) -> None:
        await self.send_q.put((identity, RequestOutput(request_id, finish_reason="abort", error=error, status=status,
                                                       retry_after=retry_after)))

    async def broadcast_status(self) -> EngineStatus:
        """Tell every frontend now (adapters changed), not at the next heartbeat."""
        status = self.status()
        for identity in list(self.frontends):
            await self.send_q.put((identity, status))
        return status

    # -- outputs ----------------------------------------------------------------------------------------
    async def deliver(self, deltas: list[RequestOutput]) -> None:
        """Each delta to the frontend that asked (a non-streaming request's only once it finished)."""
        metrics.GENERATED_TOKENS.inc(sum(len(d.token_ids) for d in deltas))
        for d in deltas:
            routed = self.routes.route(d)
            if routed is not None:
                await self.send_q.put(routed)
            if d.finish_reason is not None:
                self.processor.drop(d.request_id)

    async def fail_running(self, error: str) -> None:
        for req in list(self.core.scheduler.running):
            rid = req.request_id
            identity = self.routes.owner.get(rid)
            self.core.abort(rid)
            if identity is not None:
                await self.send_q.put((identity, RequestOutput(rid, finish_reason="abort", error=error, status=500)))
            self.forget(rid)

    def forget(self, rid: str) -> None:
        self.routes.forget(rid)
        self.processor.drop(rid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="loraplex engine process (started by `loraplex serve`)")
    p.add_argument("--address", required=True)
    p.add_argument("--engine-args", required=True, help="JSON object of EngineConfig keyword arguments")
    p.add_argument("--adapter-dir", default=None)
    p.add_argument("--adapter-source", default=None, help="an http(s) URL adapters unknown here are fetched from")
    p.add_argument("--lora-root", action="append", default=[], help="a folder runtime loads may read from")
    p.add_argument("--disable-runtime-lora", action="store_true")
    p.add_argument("--max-waiting", type=int, default=1024, help="requests waiting beyond it get a 429")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on the first SIGTERM / SIGINT: finish the requests admitted for up to this many seconds")
    p.add_argument("--state-file", default=None, help="JSON Lines journal of adapters loaded at run time "
                   "(registered again when a restarted engine starts)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)     # nothing to reload here; the launcher decides (auth_reload)
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s engine %(levelname)s %(message)s")
    try:      # a bad setting (flag or --config) is one line naming it, not a traceback
        EngineConfig.create(**json.loads(args.engine_args))
    except ValueError as e:
        print(f"loraplex: error: {e}", file=sys.stderr, flush=True)
        return 2
    import uvloop
    engine = AsyncEngine(json.loads(args.engine_args), args.address, args.adapter_dir, args.state_file,
                         args.lora_root, not args.disable_runtime_lora, args.max_waiting, args.adapter_source)

    async def run():
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal():        # the first drains (up to --shutdown-timeout), a second stops at once
            if engine.draining:
                task.cancel()
                return
            log.info("stopping: no new requests; those admitted have %.0f s to finish", args.shutdown_timeout)
            engine.drain()
            loop.call_later(args.shutdown_timeout, task.cancel)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await engine.serve()
        except asyncio.CancelledError:
            pass
    try:
        uvloop.run(run())
    except DeviceFault as e:
        log.critical("%s: exiting so that a new engine process takes over", e)
        return EXIT_DEVICE_FAULT
    return 0


EXIT_DEVICE_FAULT = 3


if __name__ == "__main__":
    sys.exit(main())
