"""What the engine's pool and adapters are doing now: the answer of GET /v1/pool and what /dashboard draws.

The engine builds a PoolReport between two steps when a frontend asks (a PoolQuery) and sends it in a
PoolReply (ipc/outputs.py). These structs are keyed objects on the wire and in the HTTP answer alike.
Times are Unix seconds (the engine's clock); byte counts are exact.
"""
from __future__ import annotations

import msgspec


class PoolPages(msgspec.Struct, kw_only=True):
    """The unified pool now, in pages (cached-but-free KV blocks count as free)."""
    kv: int
    adapters: int
    free: int
    total: int
    page_bytes: int


class PoolSample(msgspec.Struct, kw_only=True):
    """The pool's pages by use at one moment (sampled each second)."""
    at: float
    kv: int
    adapters: int
    free: int


class AdapterRow(msgspec.Struct, kw_only=True):
    """One adapter the engine knows. tier: "pool" (its pages resident), "loading" (pages being written),
    "host" (a packed copy in host memory, none in the pool), "disk" (registered, weights on disk only),
    "listed" (in --adapter-dir, never read yet), "failed" (its last load failed: `error` says why). A
    composition of several adapters (engine/lora/compose.py) is a row of its own, named "1 * a + 0.5 * b"
    (its requests are counted on its members' rows)."""
    name: str
    tier: str
    digest: str = ""              # its content (names of one content share it, and their figures)
    pool_bytes: int = 0
    host_bytes: int = 0
    file_bytes: int = 0
    pinned: bool = False
    running: int = 0              # running requests on it
    queued: int = 0               # requests admitted and not finished (running ones included)
    requests_last_minute: int = 0
    last_request: float | None = None
    error: str | None = None


class LoadRecord(msgspec.Struct, kw_only=True):
    name: str
    seconds: float                # from its load's start to its pages being ready
    at: float                     # when it finished


class TenantShare(msgspec.Struct, kw_only=True):
    """A fairness key (a tenant, or an adapter where no tenants are configured) and its virtual token
    counter (VTC: weighted tokens served); share: its counter over the sum of all counters."""
    name: str
    counter: float
    share: float
    active: int                   # its requests waiting or running


class PoolReport(msgspec.Struct, kw_only=True):
    at: float
    model: str
    running: int
    waiting: int
    pages: PoolPages
    history: list[PoolSample]     # oldest first, one a second over the last minutes
    adapters: list[AdapterRow]    # by tier (pool, loading, host, disk, failed, listed), then name
    loads_in_flight: list[str]
    recent_loads: list[LoadRecord]   # the latest last
    policy: str                   # the waiting queue's policy: "vtc" or "fcfs"
    tenants: list[TenantShare]
