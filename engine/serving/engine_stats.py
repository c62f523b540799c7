"""Publishes the engine's figures to Prometheus (gauges set, counters advanced by their deltas)."""
from __future__ import annotations

import time

from engine import metrics


class EngineStatsPublisher:
    def __init__(self, core, every: float = 0.5):
        self.core = core
        self.every = every
        self.last = 0.0
        self.seen = {"loads": 0, "evictions": 0, "cold_starts": 0, "preemptions": 0, "failed_steps": 0}

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
            st = self.core.adapters.stats
            current.update(loads=st.loads, evictions=st.evictions, cold_starts=st.cold_starts)
            metrics.ADAPTER_HIT_RATE.set(st.hit_rate)
            for tier, n in self.core.adapters.tiers().items():
                metrics.ADAPTERS.labels(tier).set(n)
        counters = {"loads": metrics.ADAPTER_LOADS, "evictions": metrics.ADAPTER_EVICTIONS,
                    "cold_starts": metrics.ADAPTER_COLD_STARTS, "preemptions": metrics.PREEMPTIONS,
                    "failed_steps": metrics.FAILED_STEPS}
        for key, value in current.items():
            if value > self.seen[key]:
                counters[key].inc(value - self.seen[key])
                self.seen[key] = value
