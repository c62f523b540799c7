"""The engine's side of GET /v1/pool (ipc/pool_report.py): what the report needs that the engine does not
keep for itself (the pool's occupancy sampled each second, each adapter's recent requests), and the
report, built on the engine thread between two steps so that it reads a consistent state.

Bounded: HISTORY_S one-second samples, and per adapter the arrival times of its last minute's requests
(expired at its next request and when a report is built; an adapter with none left is forgotten)."""
from __future__ import annotations

import time
from collections import deque

from engine.core.engine_core import EngineCore
from engine.lora.adapter_manager import AdapterState
from ipc.pool_report import AdapterRow, LoadRecord, PoolPages, PoolReport, PoolSample, TenantShare

HISTORY_S = 600          # ten minutes of samples
MINUTE = 60.0
TIER_ORDER = {"pool": 0, "loading": 1, "host": 2, "disk": 3, "failed": 4, "listed": 5}


class PoolView:
    def __init__(self, core: EngineCore, listed=lambda: set()):
        """listed(): the adapter names --adapter-dir lists (AdapterCatalog.listed), never read or read."""
        self.core = core
        self.listed = listed
        self.history: deque[PoolSample] = deque(maxlen=HISTORY_S)
        self.arrivals: dict[str, deque[float]] = {}
        self.last_request: dict[str, float] = {}

    # -- kept by the engine's event loop ------------------------------------------------------------------
    def sample(self) -> None:
        """One sample of the pool's pages by use (the heartbeat calls it each second)."""
        u = self.core.pool.usage()
        self.history.append(PoolSample(at=time.time(), kv=u["kv"], adapters=u["adapter"], free=u["free"]))

    def note_request(self, adapter: str | None) -> None:
        """A request for `adapter` arrived (None: the base model, not tracked)."""
        if adapter is None:
            return
        now = time.time()
        q = self.arrivals.setdefault(adapter, deque())
        q.append(now)
        self.last_request[adapter] = now
        self._expire_one(adapter, q, now)        # O(this adapter's expired arrivals): on every request

    def _expire(self, now: float) -> None:
        for name, q in list(self.arrivals.items()):
            self._expire_one(name, q, now)

    def _expire_one(self, name: str, q: deque[float], now: float) -> None:
        while q and q[0] < now - MINUTE:
            q.popleft()
        if not q:
            del self.arrivals[name]

    # -- built on the engine thread -----------------------------------------------------------------------
    def report(self) -> PoolReport:
        core, now = self.core, time.time()
        self._expire(now)
        u = core.pool.usage()
        page_bytes = core.runner.storage.shape[1] * core.runner.storage.element_size()
        pages = PoolPages(kv=u["kv"], adapters=u["adapter"], free=u["free"], total=core.pool.num_pages,
                          page_bytes=page_bytes)
        s = core.scheduler
        rows, in_flight, loads = self._adapters(page_bytes), [], []
        if core.adapters is not None:
            in_flight = sorted(a.name for a in core.adapters.in_flight.values())
            loads = [LoadRecord(name=n, seconds=sec, at=at) for n, sec, at in core.adapters.recent_loads]
        return PoolReport(at=now, model=core.cfg.model.name, running=len(s.running), waiting=len(s.waiting),
                          pages=pages, history=list(self.history), adapters=rows, loads_in_flight=in_flight,
                          recent_loads=loads, policy=s.waiting.policy.name, tenants=self._tenants())

    def _adapters(self, page_bytes: int) -> list[AdapterRow]:
        m = self.core.adapters
        rows: dict[str, AdapterRow] = {}
        if m is not None:
            named = [(name, a) for name, a in m.by_name.items()]    # names of one content share its figures
            composed = [(c.name, c) for c in m.composed.values()]   # compositions (engine/lora/compose.py)
            for name, a in named + composed:
                host = m.host.get(a.adapter_id)
                tier = {AdapterState.RESIDENT: "pool", AdapterState.LOADING: "loading"}.get(a.state)
                if tier is None:
                    tier = "failed" if a.error else "host" if host is not None else "disk"
                rows[name] = AdapterRow(
                    name=name, tier=tier, digest=a.digest, pool_bytes=len(a.pages) * page_bytes,
                    host_bytes=0 if host is None else host.nbytes, file_bytes=a.files.nbytes, pinned=a.pinned,
                    running=a.active, queued=a.queued, error=a.error)
        for name in self.listed():
            rows.setdefault(name, AdapterRow(name=name, tier="listed"))
        for name, row in rows.items():
            row.requests_last_minute = len(self.arrivals.get(name, ()))
            row.last_request = self.last_request.get(name)
        return sorted(rows.values(), key=lambda r: (TIER_ORDER[r.tier], r.name))

    def _tenants(self) -> list[TenantShare]:
        """The VTC counters (empty under fcfs). Requests without a tenant (no keys, or an admin's) are kept
        apart by adapter: those are named "adapter:NAME" ("adapter:(base model)" for the base model)."""
        policy = self.core.scheduler.waiting.policy
        counters: dict = getattr(policy, "counter", {})
        active: dict = getattr(policy, "active", {})
        names = {0: "(base model)"}
        if self.core.adapters is not None:
            names.update({i: a.name for i, a in self.core.adapters.by_id.items()})
        total = sum(counters.values()) or 1.0
        out = []
        for key, c in counters.items():
            name = key if isinstance(key, str) else "adapter:" + names.get(key, str(key))
            out.append(TenantShare(name=name, counter=c, share=c / total, active=active.get(key, 0)))
        return sorted(out, key=lambda t: -t.counter)
