"""Publishes the engine's figures to Prometheus (gauges set, counters advanced by their deltas)."""
from __future__ import annotations

import time

from engine import metrics


class EngineStatsPublisher:
    def __init__(self, core, every: float = 0.5, listed=lambda: 0):
        """listed(): how many adapters --adapter-dir lists (AdapterCatalog), 0 without one."""
        self.core = core
        self.listed = listed
        self.every = every
        self.last = 0.0
        self.seen = {"loads": 0, "evictions": 0, "cold_starts": 0, "preemptions": 0, "failed_steps": 0,
                     "failed_loads": 0}

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        s = self.core.scheduler
        metrics.RUNNING.set(len(s.running))
        metrics.WAITING.set(len(s.waiting))
        for kind, n in self.core.pool.usage().items():
            metrics.POOL_PAGES.labels(kind).set(n)
        current = {"preemptions": s.num_preemptions, "failed_steps": self.core.num_failed_steps}
        if self.core.adapters is not None:
            self._adapters(self.core.adapters, current)
        counters = {"loads": metrics.ADAPTER_LOADS, "evictions": metrics.ADAPTER_EVICTIONS,
                    "cold_starts": metrics.ADAPTER_COLD_STARTS, "preemptions": metrics.PREEMPTIONS,
                    "failed_steps": metrics.FAILED_STEPS, "failed_loads": metrics.ADAPTER_FAILED_LOADS}
        for key, value in current.items():
            if value > self.seen[key]:
                counters[key].inc(value - self.seen[key])
                self.seen[key] = value

    def _adapters(self, adapters, current: dict) -> None:
        st = adapters.stats
        current.update(loads=st.loads, evictions=st.evictions, cold_starts=st.cold_starts,
                       failed_loads=st.failed_loads)
        metrics.ADAPTER_HIT_RATE.set(st.hit_rate)
        tiers = adapters.tiers()
        for tier, n in {**tiers, "listed": self.listed()}.items():
            metrics.ADAPTERS.labels(tier).set(n)
        metrics.ADAPTER_LOADS_IN_FLIGHT.set(tiers["loading"])
        for tier, n in adapters.tier_bytes().items():
            metrics.ADAPTER_BYTES.labels(tier).set(n)
        for seconds, hist in ((adapters.load_seconds, metrics.ADAPTER_LOAD_SECONDS),
                              (adapters.load_waits, metrics.ADAPTER_LOAD_WAIT)):
            for t in seconds:
                hist.observe(t)
            seconds.clear()
