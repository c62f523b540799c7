"""An answer struct (api_responses) as an aiohttp JSON response."""
from __future__ import annotations

import msgspec
from aiohttp import web


def reply(body: msgspec.Struct, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers,
                        content_type="application/json")
