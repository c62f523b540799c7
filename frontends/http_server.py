"""The OpenAI-compatible HTTP frontend (aiohttp). Several of these processes share one port
(SO_REUSEPORT) and talk to the one engine over ZMQ. Prompts are tokenized here, text comes back from the
engine's detokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

import msgspec
from aiohttp import web
from jinja2 import TemplateError

from engine import envs, metrics
from engine.tokenizer import encode_chat, load_tokenizer
from frontends import api_types, ready, sse
from frontends import openai_protocol as oai
from frontends.api_types import ChatCompletionRequest, CompletionRequest, LoadLoraRequest, UnloadLoraRequest
from frontends.auth import Auth, parse_auth
from frontends.choices import Merged, choice_params, collect
from frontends.echo import Echo
from frontends.engine_client import MAX_BUFFERED, AsyncEngineClient, EngineError
from frontends.error_middleware import error_middleware, no_such_model
from frontends.openai_protocol import ApiError
from frontends.openapi import openapi_document
from frontends.stream_chunks import StreamChunks, finish_reason

log = logging.getLogger("loraplex.http")


class OpenAIServer:
    def __init__(self, client: AsyncEngineClient, auth: Auth, stream_timeout: float = 60.0):
        self.client = client
        self.stream_timeout = stream_timeout
        self.headers = {"X-Loraplex-Frontend": client.client_id}
        self.auth = auth
        self.tokenizer = load_tokenizer(client.status.model_path)
        self.labels = metrics.AdapterLabels()
        self.document = openapi_document(secured=auth.enabled)

    # -- plumbing ---------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware(self.auth)], client_max_size=8 << 20)
        app.on_response_prepare.append(self.tag_response)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models),
                        web.post("/v1/load_lora_adapter", self.load_adapter),
                        web.post("/v1/unload_lora_adapter", self.unload_adapter),
                        web.get("/health", self.health), web.get("/metrics", self.metrics),
                        web.get("/openapi.json", self.openapi)])
        return app

    async def tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(self.headers)

    @staticmethod
    async def body(request: web.Request, type_: type):
        """The body as its typed request (api_types): strict JSON (no NaN or Infinity), valid UTF-8 (no
        lone surrogates), every field of its declared type and range; a 400 naming the field otherwise."""
        try:
            return api_types.decode(await request.read(), type_)
        except api_types.DecodeFailure as e:
            raise ApiError(400, e.message, e.param) from None

    def adapter_for(self, request: web.Request, model: str) -> str | None:
        """The adapter `model` names (None: the base model), if the caller may use it; the same 404 as for
        a model that does not exist otherwise."""
        request["model"] = model
        adapter = None if model == self.client.status.model else model
        if not request["caller"].may_use(adapter):
            raise ApiError(404, no_such_model(model), "model", "model_not_found")
        return adapter

    async def check_health(self) -> None:
        """Wait out an engine restart (the client's RESTART_WAIT); 503 if the engine does not come back."""
        try:
            await self.client.until_healthy()
        except EngineError:
            raise ApiError(503, "the engine is unavailable") from None

    # -- generation -------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self.body(request, CompletionRequest)
        prompt = oai.completion_prompt(req)
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        oai.check_token_ids(ids, self.client.status.vocab_size)      # before echo decodes them
        echo = None
        if req.echo:
            echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return await self.generate(request, req, ids, echo=echo)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self.body(request, ChatCompletionRequest)
        try:
            ids = encode_chat(self.tokenizer, oai.chat_messages(req))
        except (ValueError, TemplateError) as e:       # no chat template, or one that refuses these messages
            raise ApiError(400, f"'messages': {e}", "messages") from None
        return await self.generate(request, req, ids)

    async def generate(self, request: web.Request, req: CompletionRequest | ChatCompletionRequest, ids: list[int],
                       echo: str | None = None) -> web.StreamResponse:
        """echo (completions): the prompt's text, returned before the completion (with its tokens'
        logprobs when logprobs are asked); with max_tokens 0, only the prompt (one token is computed
        and dropped: how evaluation harnesses score a text)."""
        chat = isinstance(req, ChatCompletionRequest)
        adapter = self.adapter_for(request, req.model)
        prompt_only = oai.check_length(req, len(ids), self.client.status.max_model_len, echo is not None)
        oai.refuse_unsupported(req)
        params = oai.sampling_params(req, default_max_tokens=None if chat else 16, prompt_only=prompt_only)
        if echo is not None and params.logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=params.logprobs)
        view = Echo(echo, ids, prompt_only, lambda entries, offset: self.logprobs(entries, chat, offset),
                    self.token_text)
        caller = request["caller"]
        salt = caller.cache_salt(req.cache_salt)
        n, stream = req.n or 1, bool(req.stream)
        await self.check_health()      # a bad request is answered at once, also while the engine restarts
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        tenant = caller.tenant
        gens = Merged([self.client.generate(ids, choice_params(params, i), adapter, salt, stream=stream,
                                            request_id=rid if n == 1 else f"{rid}-{i}",
                                            tenant="" if tenant is None else tenant.name,
                                            max_waiting=(tenant.max_waiting or 0) if tenant else 0)
                       for i in range(n)])
        if stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self.stream(request, gens, rid, req.model, chat, usage, adapter, view)
        start = time.monotonic()
        done = await collect(gens, lambda out: self.observe(request, adapter, out.finish_reason, start))
        use = oai.choices_usage([c.final for c in done], prompt_only)
        choices = [(view.text(c.text, True), finish_reason(c.final.finish_reason),
                    None if params.logprobs is None else view.logprobs(c.entries, c.prompt_logprobs, 0, True))
                   for c in done]
        resp = web.json_response(oai.completion_response(rid, req.model, choices, chat, use))
        await resp.prepare(request)
        await resp.write_eof()
        self.delivered(request, [c.final.finish_reason for c in done])
        return resp

    def logprobs(self, entries, chat: bool, offset: int) -> dict:
        piece = self.token_text
        return oai.chat_logprobs(entries, piece) if chat else oai.completion_logprobs(entries, piece, offset)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def stream(self, request, gens: Merged, rid, model, chat, include_usage, adapter,
                     view: Echo) -> web.StreamResponse:
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
        chunks, last_t, finishes = StreamChunks(len(gens), rid, model, chat, view), None, []
        try:
            while True:
                now = time.monotonic()
                if last_t is None:
                    metrics.TTFT.observe(now - start)
                else:
                    metrics.ITL.observe(now - last_t)
                last_t = now
                chunk = chunks.chunk(i, out)
                if chunk is not None:
                    await self.send(resp, sse.event(chunk))
                if out.finish_reason is not None:
                    self.observe(request, adapter, out.finish_reason, start)
                    finishes.append(out.finish_reason)
                    if chunks.finish(i, out):
                        break
                i, out = await gens.__anext__()
            if include_usage:
                await self.send(resp, sse.event(chunks.usage()))
            await self.send(resp, sse.DONE)
            self.delivered(request, finishes)
        except EngineError as e:
            try:
                await self.send(resp, sse.event(ApiError(e.status, str(e)).body()))
            except sse.SlowReader:
                sse.hang_up(request)
        except sse.SlowReader:
            metrics.SLOW_READERS.labels("timeout").inc()
            log.warning("client of %s read nothing for %.0f s; aborting it", rid, self.stream_timeout)
            sse.hang_up(request)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client of %s went away; aborting it", rid)
            raise
        finally:
            await gens.aclose()          # aborts the requests in the engine that are still running
        return resp

    async def send(self, resp: web.StreamResponse, data: bytes) -> None:
        await sse.send(resp, data, self.stream_timeout)

    def observe(self, request: web.Request, adapter: str | None, finish: str | None, start: float) -> None:
        metrics.E2E.observe(time.monotonic() - start)
        metrics.REQUESTS.labels(self.labels(adapter), finish or "none").inc()

    @staticmethod
    def delivered(request: web.Request, finishes: list) -> None:
        """The whole answer (every choice) was written to the client: what its tenant's counter counts."""
        for finish in finishes:
            metrics.TENANT_REQUESTS.labels(request["caller"].name, finish or "none").inc()

    # -- models and adapters ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """The base model and the adapters, those the caller may use."""
        st, caller = self.client.status, request["caller"]
        created = int(time.time())
        data = []
        if caller.may_use(None):
            data.append({"id": st.model, "object": "model", "created": created, "owned_by": "loraplex",
                         "root": st.model, "parent": None, "max_model_len": st.max_model_len})
        data += [{"id": a, "object": "model", "created": created, "owned_by": "loraplex", "root": a,
                  "parent": st.model} for a in st.adapters if caller.may_use(a)]
        return web.json_response({"object": "list", "data": data})

    @staticmethod
    def require_admin(request: web.Request) -> None:
        if not request["caller"].is_admin:
            raise ApiError(403, "loading and unloading adapters needs an admin key", code="permission_denied")

    async def load_adapter(self, request: web.Request) -> web.Response:
        self.require_admin(request)
        req = await self.body(request, LoadLoraRequest)
        name = req.lora_name
        await self.check_health()
        await self.client.load_adapter(name, req.lora_path or "", bool(req.pinned))
        return web.json_response({"status": "ok", "message": f"adapter {name!r} loaded"})

    async def unload_adapter(self, request: web.Request) -> web.Response:
        self.require_admin(request)
        name = (await self.body(request, UnloadLoraRequest)).lora_name
        await self.check_health()
        await self.client.unload_adapter(name)
        return web.json_response({"status": "ok", "message": f"adapter {name!r} unloaded"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.document)

    async def health(self, request: web.Request) -> web.Response:
        if not self.client.healthy:
            return web.json_response({"status": "engine unavailable"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
        status = self.auth.metrics_access(request.headers.get("Authorization", ""))
        if status == 401:
            raise ApiError(401, "/metrics needs an admin key or a metrics key", code="invalid_api_key")
        if status == 403:
            raise ApiError(403, "/metrics is for admins and the metrics scraper, not tenants", code="forbidden")
        if envs.prometheus_dir():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            from prometheus_client import REGISTRY as registry
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(engine_address: str, host: str, port: int, auth: Auth, frontend_id: str,
                stream_timeout: float = 60.0, stream_buffer: int = MAX_BUFFERED,
                shutdown_timeout: float = 30.0) -> None:
    """Serve until SIGTERM / SIGINT; then stop listening and give running requests `shutdown_timeout`
    seconds to finish (aiohttp's graceful shutdown) before closing."""
    client = await AsyncEngineClient(engine_address, frontend_id, stream_buffer).connect(timeout=600)
    server = OpenAIServer(client, auth, stream_timeout)
    # handler_cancellation: a client that goes away cancels its handler, which aborts its engine requests
    # (also for non-streamed requests, which write nothing until they finish)
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=True)
    await site.start()
    ready.announce(frontend=frontend_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: no new connections; running requests have %.0f s to finish", shutdown_timeout)
    await runner.cleanup()
    await client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="loraplex HTTP frontend (started by `loraplex serve`)")
    p.add_argument("--engine-address", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--frontend-id", default=f"http-{os.getpid()}")
    p.add_argument("--stream-timeout", type=float, default=60.0)
    p.add_argument("--stream-buffer", type=int, default=MAX_BUFFERED)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    auth = parse_auth(envs.auth_config(), envs.api_key())
    logging.basicConfig(level=envs.log_level(),
                        format=f"%(asctime)s {args.frontend_id} %(levelname)s %(message)s")
    import uvloop
    uvloop.run(serve(args.engine_address, args.host, args.port, auth, args.frontend_id, args.stream_timeout,
                     args.stream_buffer, args.shutdown_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
