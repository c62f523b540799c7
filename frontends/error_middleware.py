"""Every answer of the HTTP frontend in OpenAI's error shape, and who is calling.

The middleware notes the request's id (frontends/request_id.py: the caller's `X-Request-Id`, a 400 for one it
cannot take), resolves the caller from its API key (401 on /v1/*, /dashboard, /tokenize and /detokenize
without a valid one; frontends/auth.py), then turns what a handler raises into a JSON error: ApiError as it
says, the engine's refusals with their status (a 404 for an adapter a tenant may not see reads as any unknown
model; a 429 carries Retry-After), aiohttp's own 4xx (unknown route, method, a body too large), and a bug of
ours as a logged 500 (on a stream already started, aiohttp closes the connection instead).
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from aiohttp import web

from frontends.api_error import ApiError
from frontends.auth import ANONYMOUS_ADMIN, Auth
from frontends.engine_client import EngineError
from frontends.reply import reply
from frontends.request_id import HEADER, new_request_id, request_id

log = logging.getLogger("loraplex.http")
DASHBOARD = "/dashboard"     # the page (frontends/dashboard.html), outside /v1/, needs a key as /v1/* does
KEYED = (DASHBOARD, "/tokenize", "/detokenize")      # as do vLLM's tokenizer routes (frontends/tokenize_endpoint.py)
RETRY_AFTER_S = 1     # what a 429 tells the client to wait at least (a rate limit may say more)


def no_such_model(model) -> str:
    return f"The model {model!r} does not exist"


def note_request_id(request: web.Request) -> None:
    """request["request_id"]: the caller's X-Request-Id, or a new one; ApiError 400 for one it cannot take
    (its answer then carries a new one)."""
    request["request_id"] = new_request_id()
    try:
        request["request_id"] = request_id(request.headers.get(HEADER))
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_request_id") from None


def error_middleware(auth_now: Callable[[], Auth]):
    """The aiohttp middleware; it sets request["request_id"] and request["caller"] for the handlers. auth_now:
    the keys and tenants in force (a SIGHUP may replace them: frontends/auth_reload.py)."""
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            note_request_id(request)
            caller = auth_now().caller(request.headers.get("Authorization", ""))
            if (request.path.startswith("/v1/") or request.path in KEYED) and caller is None:
                raise ApiError(401, "missing or wrong API key", code="invalid_api_key")
            request["caller"] = caller or ANONYMOUS_ADMIN
            return await handler(request)
        except ApiError as e:
            # a browser asks for the key (Basic credentials) when the page itself is refused
            page = e.status == 401 and request.path == DASHBOARD
            ask = {"WWW-Authenticate": 'Basic realm="loraplex"'} if page else None
            return reply(e.response(), e.status, ask)
        except EngineError as e:
            message = str(e)
            if e.status == 404 and not request.get("caller", ANONYMOUS_ADMIN).is_admin:
                message = no_such_model(request.get("model"))    # a tenant learns nothing of the server
            wait = max(RETRY_AFTER_S, math.ceil(e.retry_after))     # a tenant's rate limit says how long
            headers = {"Retry-After": str(wait)} if e.status == 429 else None
            return reply(ApiError(e.status, message).response(), e.status, headers)
        except web.HTTPException as e:       # no such route (404), method (405), a body too large (413)
            if e.status < 400:
                raise
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return reply(ApiError(e.status, e.reason).response(), e.status, headers)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:       # a bug of ours: logged with its traceback, answered in the usual error shape
            log.exception("unexpected error in %s %s", request.method, request.path)
            if request.get("streaming"):
                raise                  # the status line is sent: aiohttp closes the connection
            return reply(ApiError(500, "internal error (logged by the server)").response(), 500)
    return errors
