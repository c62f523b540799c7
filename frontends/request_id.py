"""`X-Request-Id`: the id of one HTTP request, on its answer, for tracing it across a platform's services.

OpenAI's answers carry one (the official client shows it as `._request_id`), and vLLM echoes a caller's.
Invariants: every answer of a frontend (and of the Ray ingress) carries exactly one, errors and streams
included; a caller's own id (1-128 visible ASCII characters) comes back unchanged; without one (or an empty
one) the server makes `req_` + 32 hex digits. The id is the caller's label only: the engine's request ids
stay the server's own (two callers may send the same id), and the frontend's logs name both.
"""
from __future__ import annotations

import uuid

HEADER = "X-Request-Id"
MAX_LEN = 128


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def request_id(sent: str | None) -> str:
    """The id of a request whose `X-Request-Id` header is `sent` (None: no header): `sent` itself, or a new one
    when it is missing or empty. ValueError naming the rule for one too long or with other characters."""
    if not sent:
        return new_request_id()
    if len(sent) > MAX_LEN or not all("!" <= ch <= "~" for ch in sent):
        raise ValueError(f"{HEADER} must be 1-{MAX_LEN} visible ASCII characters (no spaces), "
                         f"got {len(sent)} characters: {sent[:40]!r}")
    return sent


def traced(request, rid: str) -> str:
    """How the frontend's log names a generation request: the completion's id and the request's own id
    (`request`: the aiohttp request, whose "request_id" the error middleware set)."""
    return f"{rid} ({HEADER} {request.get('request_id')})"
