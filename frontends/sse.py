"""Server-sent events to one client, bounded: a client that takes nothing for `timeout` seconds is a
SlowReader and is hung up on; the kernel's send buffer for the response is pinned small."""
from __future__ import annotations

import asyncio
import socket

import msgspec
from aiohttp import web

STREAM_SNDBUF = 64 << 10     # bytes the kernel holds for one streamed response (no autotuning to megabytes)
DONE = b"data: [DONE]\n\n"


class SlowReader(Exception):
    """A streaming client took nothing for the stream timeout."""


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the status line and headers of an event stream (after this, errors go in the stream)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    request["streaming"] = True
    _bound_send_buffer(request)
    return resp


def event(body: msgspec.Struct) -> bytes:
    """One event whose data is an answer struct (api_responses), as JSON."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def send(resp: web.StreamResponse, data: bytes, timeout: float) -> None:
    """Write one event; SlowReader if the client has taken none for `timeout` seconds (what waits for it
    is bounded: the send buffer, aiohttp's 64 KiB, the client library's outputs per request)."""
    try:
        await asyncio.wait_for(resp.write(data), timeout)
    except asyncio.TimeoutError:
        raise SlowReader() from None


def hang_up(request: web.Request) -> None:
    """Close a slow reader's connection at once, dropping what its buffers hold."""
    if request.transport is not None:
        request.transport.abort()


def _bound_send_buffer(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
    except (AttributeError, OSError):       # not a TCP socket (tests), or refused: the default buffer stays
        pass
