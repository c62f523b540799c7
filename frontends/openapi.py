"""`/openapi.json`: the HTTP API as an OpenAPI 3.1 document, generated from the typed requests
(`api_requests`, what the server decodes bodies with) and the typed answers (`api_responses`, what it
encodes and sends)."""
from __future__ import annotations

import msgspec

from frontends import api_requests as q
from frontends import api_responses as r
from frontends import responses_api as x
from frontends.request_id import HEADER, MAX_LEN
from ipc.pool_report import PoolReport

_REF = "#/components/schemas/{name}"
_ERRORS = {"400": "the request is invalid (the error names the field)", "401": "missing or wrong API key",
           "403": "needs an admin key (or, for /metrics, a metrics key)",
           "404": "no such model or adapter, or not one the caller may use",
           "429": "too many requests are waiting, or the tenant is over a rate limit (see Retry-After)",
           "503": "the engine is unavailable"}


def _json(ref: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ref}}}}


def _operation(summary: str, response: str, request: str | None = None, chunk: str | None = None,
               errors: tuple[str, ...] = ("400", "401", "404", "429", "503")) -> dict:
    ok = _json(_REF.format(name=response), "success")
    if chunk is not None:
        ok["content"]["text/event-stream"] = {
            "schema": {"type": "string", "contentMediaType": "text/event-stream"},
            "description": f"with `stream` true: server-sent events, each `data:` a {chunk} (JSON), then "
                           f"`data: [DONE]`; an error after the first event is an ErrorResponse event",
            "x-event-schema": {"$ref": _REF.format(name=chunk)}}
    op = {"summary": summary, "responses": {"200": ok}}
    for code in errors:
        op["responses"][code] = _json(_REF.format(name="ErrorResponse"), _ERRORS[code])
    if request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(name=request)}}}}
    return op


_ID_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_LEN, "pattern": "^[!-~]+$"}


def _traced(paths: dict) -> None:
    """Every operation takes an optional X-Request-Id and every answer carries one (frontends/request_id.py)."""
    for op in (op for methods in paths.values() for op in methods.values()):
        op["parameters"] = [{"name": HEADER, "in": "header", "required": False, "schema": _ID_SCHEMA,
                             "description": "the caller's id for this request, echoed on the answer"}]
        for answer in op["responses"].values():
            answer["headers"] = {HEADER: {"schema": _ID_SCHEMA, "description": "the caller's X-Request-Id, "
                                          "or one the server made (`req_` + 32 hex digits)"}}


def openapi_document(secured: bool) -> dict:
    """The document. secured: the server was started with keys ([auth] or --api-key): /v1/* needs a bearer key."""
    types = [q.CompletionRequest, q.ChatCompletionRequest, q.LoadLoraRequest, q.UnloadLoraRequest,
             q.TokenizeRequest, q.DetokenizeRequest, r.Completion, r.ChatCompletion, r.ChatCompletionChunk,
             r.ModelList, r.StatusReply, r.TokenizeReply, r.DetokenizeReply, r.ErrorResponse, PoolReport,
             x.ResponsesRequest, x.Response, x.StreamEvent]
    _, components = msgspec.json.schema_components(types, ref_template=_REF)
    admin = ("400", "401", "403", "404", "503")
    paths = {
        "/v1/completions": {"post": _operation("Complete a prompt", "Completion", "CompletionRequest", "Completion")},
        "/v1/chat/completions": {"post": _operation("Answer a conversation", "ChatCompletion",
                                                    "ChatCompletionRequest", "ChatCompletionChunk")},
        "/v1/responses": {"post": _operation("Answer an input, as OpenAI's Responses API (stateless)", "Response",
                                             "ResponsesRequest", "StreamEvent")},
        "/v1/models": {"get": _operation("The base model and the adapters the caller may use", "ModelList",
                                         errors=("401",))},
        "/tokenize": {"post": _operation("The token ids a generation would run on: a prompt as /v1/completions "
                                         "tokenizes it, or messages through the chat template", "TokenizeReply",
                                         "TokenizeRequest", errors=("400", "401", "404"))},
        "/detokenize": {"post": _operation("Token ids back to text", "DetokenizeReply", "DetokenizeRequest",
                                           errors=("400", "401", "404"))},
        "/v1/load_lora_adapter": {"post": _operation("Load (register) an adapter", "StatusReply",
                                                     "LoadLoraRequest", errors=admin)},
        "/v1/unload_lora_adapter": {"post": _operation("Unload an adapter", "StatusReply", "UnloadLoraRequest",
                                                       errors=admin)},
        "/v1/pool": {"get": _operation("The pool, the adapters by tier, loads and tenants' shares, now (admin)",
                                       "PoolReport", errors=("401", "403", "503"))},
        "/dashboard": {"get": {"summary": "A live page of /v1/pool (admin; a browser may give the key as Basic "
                                          "credentials, the key as password)",
                               "responses": {"200": {"description": "one HTML page with its script",
                                                     "content": {"text/html": {"schema": {"type": "string"}}}},
                                             **{c: _json(_REF.format(name="ErrorResponse"), _ERRORS[c])
                                                for c in ("401", "403")}}}},
        "/health": {"get": {"summary": "200 while the engine answers, 503 otherwise", "security": [],
                            "responses": {"200": _json(_REF.format(name="StatusReply"), "healthy"),
                                          "503": _json(_REF.format(name="StatusReply"), "engine unavailable")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (with keys configured: an admin key or a metrics key)",
                             "responses": {"200": {"description": "Prometheus text format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           **{c: _json(_REF.format(name="ErrorResponse"), _ERRORS[c])
                                              for c in ("401", "403")}}}},
        "/openapi.json": {"get": {"summary": "This document", "security": [], "responses": {"200": {
            "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
    }
    events = paths["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    events["x-event-schema"] = {"anyOf": [{"$ref": _REF.format(name=t.__name__)} for t in x.StreamEvent.__args__]}
    events["description"] = ("with `stream` true: server-sent events, each `event:` its type and `data:` the "
                             "event (JSON), from response.created to response.completed (or response.incomplete)")
    _traced(paths)
    doc = {"openapi": "3.1.0", "info": {"title": "loraplex", "version": "1",
                                        "description": "OpenAI-compatible API over one base model and its LoRA "
                                                       "adapters; `model` names either."},
           "paths": paths, "components": {"schemas": components}}
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
