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
from pathlib import Path

from aiohttp import web

from engine import envs, metrics
from engine.tokenizer import load_tokenizer, read_chat_template, tokenizer_only
from frontends import api_requests, ready
from frontends import api_responses as r
from frontends.api_error import ApiError
from frontends.api_requests import LoadLoraRequest, UnloadLoraRequest
from frontends.auth import Auth, parse_auth
from frontends.chat_endpoint import ChatEndpoint
from frontends.completions_endpoint import CompletionsEndpoint
from frontends.engine_client import MAX_BUFFERED, AsyncEngineClient
from frontends.error_middleware import error_middleware
from frontends.openapi import openapi_document
from frontends.reply import reply
from frontends.request_id import HEADER as REQUEST_ID
from frontends.request_id import new_request_id
from frontends.request_log import note, request_log_middleware
from frontends.responses_endpoint import ResponsesEndpoint
from frontends.tokenize_endpoint import TokenizeEndpoints
from frontends.tool_parsers import PARSERS

log = logging.getLogger("loraplex.http")
DASHBOARD = (Path(__file__).parent / "dashboard.html").read_text()


class OpenAIServer:
    """The routes: the two generation endpoints (frontends/completions_endpoint.py, chat_endpoint.py),
    models, adapter loading (admin), health, metrics and the OpenAPI document. Every JSON answer is an
    api_responses struct."""

    def __init__(self, client: AsyncEngineClient, auth: Auth, stream_timeout: float = 60.0, log_requests: bool = False,
                 tool_parser: str | None = None, chat_template: str | None = None):
        """log_requests: one JSON line per POST /v1/* request (frontends/request_log.py); tool_parser,
        chat_template: --tool-call-parser and --chat-template's text (frontends/chat_endpoint.py)."""
        self.client, self.log_requests = client, log_requests
        self.headers = {"X-Loraplex-Frontend": client.client_id}
        self.auth = auth
        tokenizer, labels = load_tokenizer(client.status.model_path), metrics.AdapterLabels()
        self.completions = CompletionsEndpoint(client, tokenizer, labels, stream_timeout)
        self.chat = ChatEndpoint(client, tokenizer, labels, stream_timeout, tool_parser=tool_parser,
                                 chat_template=chat_template)
        self.responses = ResponsesEndpoint(client, tokenizer, labels, stream_timeout, tool_parser=tool_parser,
                                           chat_template=chat_template)
        self.tokens = TokenizeEndpoints(self.completions, self.chat)
        self.document = openapi_document(secured=auth.enabled)

    def reload_auth(self, quiet: bool = False) -> None:
        """SIGHUP: the keys and tenants the launcher has written again (frontends/auth_reload.py); a table that
        does not parse leaves the running one (the launcher checked it first)."""
        try:
            self.auth = load_auth()
        except (ValueError, OSError) as e:
            log.error("[auth] not reloaded, the running keys stay: %s", e)
            return
        self.document = openapi_document(secured=self.auth.enabled)
        if not quiet:
            log.info("[auth] reloaded: %d tenant(s)", len(self.auth.tenants))

    def app(self) -> web.Application:
        logged = [request_log_middleware()] if self.log_requests else []
        app = web.Application(middlewares=[*logged, error_middleware(lambda: self.auth)], client_max_size=8 << 20)
        app.on_response_prepare.append(self.tag_response)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat),
                        web.post("/v1/responses", self.responses),
                        web.get("/v1/models", self.models),
                        web.post("/tokenize", self.tokens.tokenize), web.post("/detokenize", self.tokens.detokenize),
                        web.post("/v1/load_lora_adapter", self.load_adapter),
                        web.post("/v1/unload_lora_adapter", self.unload_adapter),
                        web.get("/v1/pool", self.pool), web.get("/dashboard", self.dashboard),
                        web.get("/health", self.health), web.get("/metrics", self.metrics),
                        web.get("/openapi.json", self.openapi)])
        return app

    async def tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(self.headers)
        response.headers[REQUEST_ID] = request.get("request_id") or new_request_id()  # set unless aiohttp refused it

    # -- models and adapters ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """The base model and the adapters, those the caller may use."""
        st, caller = self.client.status, request["caller"]
        created = int(time.time())
        data = []
        if caller.may_use(None):
            data.append(r.Model(id=st.model, object="model", created=created, owned_by="loraplex", root=st.model,
                                parent=None, max_model_len=st.max_model_len))
        digests = dict(zip(st.adapters, st.digests))
        data += [r.Model(id=a, object="model", created=created, owned_by="loraplex", root=a, parent=st.model,
                         digest=digests.get(a) or None) for a in st.adapters if caller.may_use(a)]
        return reply(r.ModelList(object="list", data=data))

    @staticmethod
    def require_admin(request: web.Request) -> None:
        if not request["caller"].is_admin:
            raise ApiError(403, "loading and unloading adapters needs an admin key", code="permission_denied")

    async def load_adapter(self, request: web.Request) -> web.Response:
        self.require_admin(request)
        req = await api_requests.read(request, LoadLoraRequest)
        note(request, adapter=req.lora_name)
        await self.client.until_healthy()
        await self.client.load_adapter(req.lora_name, req.lora_path or "", bool(req.pinned))
        return reply(r.StatusReply(status="ok", message=f"adapter {req.lora_name!r} loaded"))

    async def unload_adapter(self, request: web.Request) -> web.Response:
        self.require_admin(request)
        name = (await api_requests.read(request, UnloadLoraRequest)).lora_name
        note(request, adapter=name)
        await self.client.until_healthy()
        await self.client.unload_adapter(name)
        return reply(r.StatusReply(status="ok", message=f"adapter {name!r} unloaded"))

    # -- the pool, live ----------------------------------------------------------------------------------
    async def pool(self, request: web.Request) -> web.Response:
        """The engine's pool and adapters now (ipc/pool_report.py); admins only: it names every adapter and
        tenant."""
        if not request["caller"].is_admin:
            raise ApiError(403, "/v1/pool is for admins", code="permission_denied")
        await self.client.until_healthy()
        return reply(await self.client.pool_report())

    async def dashboard(self, request: web.Request) -> web.Response:
        """One static page (frontends/dashboard.html, no external assets) that draws GET /v1/pool each second.
        With keys configured it needs an admin key: a browser gives it as Basic credentials (any user name,
        the key as password), which it then sends with the page's own calls."""
        if not request["caller"].is_admin:
            raise ApiError(403, "/dashboard is for admins", code="permission_denied")
        return web.Response(text=DASHBOARD, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.document)

    async def health(self, request: web.Request) -> web.Response:
        if not self.client.healthy:
            return reply(r.StatusReply(status="engine unavailable"), 503)
        return reply(r.StatusReply(status="ok"))

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
                shutdown_timeout: float = 30.0, log_requests: bool = False, chat: dict | None = None) -> None:
    """Serve until SIGTERM / SIGINT; then stop listening and give running requests `shutdown_timeout`
    seconds to finish (aiohttp's graceful shutdown) before closing. chat: OpenAIServer's tool_parser and
    chat_template."""
    client = await AsyncEngineClient(engine_address, frontend_id, stream_buffer).connect(timeout=600)
    server = OpenAIServer(client, auth, stream_timeout, log_requests, **(chat or {}))
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
    loop.add_signal_handler(signal.SIGHUP, server.reload_auth)
    server.reload_auth(quiet=True)       # a reload between this process's start and now was not heard
    await stop.wait()
    log.info("stopping: no new connections; running requests have %.0f s to finish", shutdown_timeout)
    await runner.cleanup()
    await client.close()


def load_auth() -> Auth:
    """The keys and tenants in force: the [auth] table the launcher wrote, --api-key, the Ray ingress's key."""
    return parse_auth(envs.auth_config(), envs.api_key(), envs.ingress_metrics_key())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="loraplex HTTP frontend (started by `loraplex serve`)")
    p.add_argument("--engine-address", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--frontend-id", default=f"http-{os.getpid()}")
    p.add_argument("--stream-timeout", type=float, default=60.0)
    p.add_argument("--stream-buffer", type=int, default=MAX_BUFFERED)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--tool-call-parser", choices=tuple(PARSERS), default=None)
    p.add_argument("--chat-template", default=None, help="a Jinja file replacing the model's chat template")
    args = p.parse_args(argv)
    chat = {"tool_parser": args.tool_call_parser, "chat_template": read_chat_template(args.chat_template)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)    # a reload before serve() takes over: this start reads the file
    tokenizer_only()      # this process never computes: its tokenizer loads without torch
    auth = load_auth()
    logging.basicConfig(level=envs.log_level(),
                        format=f"%(asctime)s {args.frontend_id} %(levelname)s %(message)s")
    import uvloop
    uvloop.run(serve(args.engine_address, args.host, args.port, auth, args.frontend_id, args.stream_timeout,
                     args.stream_buffer, args.shutdown_timeout, args.enable_log_requests, chat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
