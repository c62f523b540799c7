"""Messages from the engine back to the frontend that asked."""
from __future__ import annotations

import msgspec

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False, tag_field="t")


class RequestOutput(msgspec.Struct, tag="out", **_STRUCT):
    """New tokens and the stable text they completed since the last output of this request.
    `finish_reason` is set on the last one ("stop", "length" or "abort"); `error` on a refused request."""
    request_id: str
    token_ids: list[int] = []
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class AdapterReply(msgspec.Struct, tag="adapter", **_STRUCT):
    command_id: str
    ok: bool
    error: str | None = None
    adapters: list[str] = []


EngineOutput = RequestOutput | AdapterReply
_decoder = msgspec.msgpack.Decoder(list[EngineOutput])
_encoder = msgspec.msgpack.Encoder()


def encode_outputs(msgs: list[EngineOutput]) -> bytes:
    return _encoder.encode(msgs)


def decode_outputs(data: bytes) -> list[EngineOutput]:
    return _decoder.decode(data)
