"""Messages from frontends (and the offline API) to the engine.

Every message is a tagged `msgspec.Struct`; `decode_request` turns bytes back into the right one.
"""
from __future__ import annotations

import msgspec

from ipc.sampling_params import SamplingParams

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False, tag_field="t")


class RateLimit(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tenant's rate limits (0: none) and what one request costs against them: 1 request, and its prompt
    plus the tokens it may generate, times its choices, summed over a batch's prompts
    (engine/serving/rate_limits.py). A call of n choices (per prompt) is that many GenerateRequests; the first
    carries the whole cost, the others none."""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    requests: int = 0
    tokens: int = 0


class GenerateRequest(msgspec.Struct, tag="gen", **_STRUCT):
    """Generate from `prompt_token_ids` with the named adapter (None: the base model).
    `stream`: send each new piece of text as it is ready (else only the final output). A request resent
    after an engine restart carries its earlier output at the end of its prompt (`resumed` tokens): the
    engine's detokenizer replays them, so text it had held back is not lost and a stop string that
    straddles the resend point is found."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    cache_salt: str | None = None
    stream: bool = True
    resumed: int = 0          # the last `resumed` prompt tokens are this request's own earlier output
    resumed_chars: int = 0    # (resent after an engine restart), of whose text the client has this much
    tenant: str = ""          # who sent it ("" without tenants): the engine bounds each tenant's queue
    max_waiting: int = 0      # that tenant's own bound on its waiting requests (0: only the global one)
    adapters: list[tuple[str, float]] | None = None   # several adapters, each times its weight, instead of
    # `adapter` (engine/lora/compose.py)
    rate: RateLimit | None = None   # its tenant's rate limits and this request's cost (None: not limited)


class AbortRequest(msgspec.Struct, tag="abort", **_STRUCT):
    request_ids: list[str]


class AdapterCommand(msgspec.Struct, tag="adapter", **_STRUCT):
    """op: "load" (name, path, pinned), "unload" (name) or "list"; answered by an AdapterReply."""
    command_id: str
    op: str
    name: str = ""
    path: str = ""
    pinned: bool = False


class PoolQuery(msgspec.Struct, tag="pool", **_STRUCT):
    """Ask for a PoolReport (ipc/pool_report.py), answered by a PoolReply."""
    command_id: str


class RateSync(msgspec.Struct, tag="rates", **_STRUCT):
    """Behind Ray Serve, twice a second from each replica: what the tenants' rate limits were charged on the
    other replicas' engines, cumulative ({tenant: {limit: units}}, engine/serving/rate_limits.py; None: only
    asking); answered by a RateSyncReply with this engine's own."""
    command_id: str
    others: dict[str, dict[str, float]] | None = None


class Hello(msgspec.Struct, tag="hello", **_STRUCT):
    """A frontend announces itself; the engine answers with an EngineStatus and keeps it updated."""
    frontend_id: str


EngineRequest = GenerateRequest | AbortRequest | AdapterCommand | PoolQuery | RateSync | Hello
_decoder = msgspec.msgpack.Decoder(EngineRequest)
_encoder = msgspec.msgpack.Encoder()


def encode_request(msg: EngineRequest) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> EngineRequest:
    return _decoder.decode(data)
