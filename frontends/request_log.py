"""`--enable-log-requests`: one JSON line per POST /v1/* request (generations, adapter loads and unloads), logged
when its answer has been sent (a stream: when it ends), as an operator's record of who asked what.

Fields: `request_id` (X-Request-Id, frontends/request_id.py), `method`, `path`, `status` (the HTTP status, or
"client_gone" when the caller left first), `tenant` (a tenant's name, or "admin": an admin key, or no keys
configured; null for a request refused before its key was read), `model`, and for generations `id` (the
completion's id), `prompt_tokens` / `completion_tokens` / `cached_tokens` (once every choice has finished),
`finish_reasons`, `ttft_s` (streams: to the first event), `outcome` for a stream that did not end whole
("client_gone", "slow_reader", "engine_error"); for loads and unloads `adapter`; `seconds` (to the end of the
answer); for a refusal (or an engine error) `error`, its message. Prompts and generated text are never logged.
The handlers add their fields to request["log"]; this middleware, the outermost, writes the line, after the
error middleware has made any error an answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

log = logging.getLogger("loraplex.requests")


def note(request: web.Request, **fields) -> None:
    """Add fields to the request's log line. Always kept (one small dict a request); written only where the
    server logs requests."""
    request.setdefault("log", {}).update(fields)


def _error_message(response: web.StreamResponse) -> str | None:
    body = getattr(response, "body", None)
    if response.status < 400 or not isinstance(body, bytes):
        return None
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None


def _record(request: web.Request, status, start: float, error: str | None) -> str:
    caller = request.get("caller")
    rec = {"request_id": request.get("request_id"), "method": request.method, "path": request.path,
           "status": status, "tenant": caller.name if caller else None, "model": request.get("model"),
           **request.get("log", {}), "seconds": round(time.monotonic() - start, 4)}
    if error is not None:
        rec["error"] = error
    return json.dumps(rec, separators=(",", ":"))


def request_log_middleware():
    @web.middleware
    async def requests_log(request: web.Request, handler):
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        start = time.monotonic()
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            log.info("%s", _record(request, "client_gone", start, None))
            raise
        log.info("%s", _record(request, response.status, start, _error_message(response)))
        return response
    return requests_log
