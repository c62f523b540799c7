"""Messages from the engine back to the frontend that asked."""
from __future__ import annotations

import msgspec

from ipc.pool_report import PoolReport

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False, tag_field="t")


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Log-probabilities (natural log, of the model's distribution before temperature or truncation) of
    one generated token and of the `top` most likely tokens at its position, most likely first."""
    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


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
    status: int = 0          # with `error`: the HTTP status it maps to (400 bad input, 404 unknown adapter)
    logprobs: list[TokenLogprobs] = []   # one per token of token_ids, when the request asked for logprobs
    # in the first output, when the request asked for prompt_logprobs: one per prompt token, None first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    retry_after: float = 0.0   # with a 429: seconds until the request would be let in (a tenant's rate limit)


class AdapterReply(msgspec.Struct, tag="adapter", **_STRUCT):
    command_id: str
    ok: bool
    error: str | None = None
    adapters: list[str] = []


class EngineStatus(msgspec.Struct, tag="status", **_STRUCT):
    """Sent to every frontend about once a second and after adapter changes: a heartbeat."""
    model: str
    model_path: str
    max_model_len: int
    adapters: list[str]
    running: int = 0
    waiting: int = 0
    incarnation: str = ""    # changes when the engine process is restarted
    vocab_size: int = 0      # token ids are in [0, vocab_size); 0: not told
    digests: list[str] = []  # each adapter's content digest (engine/lora/digest.py), "" if never read yet


class PoolReply(msgspec.Struct, tag="pool", **_STRUCT):
    """The answer to a PoolQuery."""
    command_id: str
    report: PoolReport


class RateSyncReply(msgspec.Struct, tag="rates", **_STRUCT):
    """The answer to a RateSync: what this engine (`incarnation`) has charged its tenants' rate limits since
    it started, cumulative ({tenant: {limit: units}})."""
    command_id: str
    incarnation: str
    charged: dict[str, dict[str, float]] = {}


EngineOutput = RequestOutput | AdapterReply | EngineStatus | PoolReply | RateSyncReply
_decoder = msgspec.msgpack.Decoder(list[EngineOutput])
_encoder = msgspec.msgpack.Encoder()


def encode_outputs(msgs: list[EngineOutput]) -> bytes:
    return _encoder.encode(msgs)


def decode_outputs(data: bytes) -> list[EngineOutput]:
    return _decoder.decode(data)
