"""Adapter-aware admission for the scheduler.

Rules: at most `max_distinct` distinct adapters among running requests (base requests do not count): the
smaller of `max_loras` and the backend's slot count, or no count at all on a backend that reads adapters in
the pool's pages (Triton) with max_loras unset, where the pool alone bounds it; a request runs only once
its adapter is resident in the pool and holds a compute slot; requests whose
adapter is loading wait in the queue without holding anyone up, and their loads are started (prefetched)
as soon as the scheduler sees them, but only for as many requests as there are free places (loads for
requests further back would evict the adapters of those ahead: with many adapters, the pool thrashed).
When the oldest waiting request has been held back by the cap (or, without a cap, by a pool too full of
running adapters to load its own) for `starvation_steps` steps, no new adapter is admitted until it fits.
"""
from __future__ import annotations

import time

from engine.config import LoraConfig
from engine.lora.adapter_manager import AdapterManager, AdapterState
from engine.request import Request
from kernels.backend import AdapterSlots


class AdapterAdmission:
    def __init__(self, cfg: LoraConfig, adapters: AdapterManager, slots: AdapterSlots):
        self.cfg = cfg
        self.adapters = adapters
        self.slots = slots
        self.running: dict[int, int] = {}     # adapter id -> running requests
        caps = [c for c in (cfg.max_loras, slots.capacity) if c is not None]
        self.max_distinct: int | None = min(caps) if caps else None

    def prefetch(self, req: Request, reserve: int = 0) -> bool:
        """Start loading req's adapter ahead of its turn, if that fits beside `reserve` free pages
        without evicting an adapter queued requests need. False when there was no room."""
        if req.adapter_id:
            a = self.adapters.by_id[req.adapter_id]
            if a.state == AdapterState.DISK:
                return self.adapters.start_load(a, evict_queued=False, reserve=reserve)
        return True

    def can_admit(self, req: Request, freeze_new: bool, may_load: bool = True) -> bool:
        """True when `req` may start running now; starts its adapter's load if needed and `may_load`
        (the scheduler allows loads only for requests that a free place awaits: a load for a request
        further back would evict adapters that the requests ahead of it are about to use)."""
        aid = req.adapter_id
        if not aid:
            return True
        capped = self.max_distinct is not None and len(self.running) >= self.max_distinct
        if aid not in self.running and (capped or freeze_new):
            req.blocked_by_cap += 1
            return False
        if not self.adapters.is_resident(aid):
            req.cold_start = True
            if req.load_wait_start is None:
                req.load_wait_start = time.monotonic()
            if may_load and not self.adapters.start_load(self.adapters.by_id[aid]):
                req.blocked_by_cap += 1      # the pool is full of running adapters and KV
            return False
        return self.slots.has(aid) or self.slots.can_assign(set(self.running))

    def admit(self, req: Request) -> None:
        aid = req.adapter_id
        if not aid:
            return
        if not req.counted:
            req.counted = True
            if req.cold_start:
                self.adapters.stats.cold_starts += 1
                self.adapters.load_waits.append(time.monotonic() - req.load_wait_start)
            else:
                self.adapters.stats.hits += 1
        a = self.adapters.by_id[aid]
        self.adapters.acquire(aid)
        self.slots.assign(aid, a.layout, a.pages, set(self.running))
        self.running[aid] = self.running.get(aid, 0) + 1

    def stop_running(self, req: Request) -> None:
        """The request leaves the running set (finished or preempted)."""
        aid = req.adapter_id
        if not aid:
            return
        n = self.running[aid] - 1
        if n:
            self.running[aid] = n
        else:
            del self.running[aid]
        self.adapters.release(aid)

    def finished(self, req: Request) -> None:
        if req.adapter_id:
            self.adapters.dequeue(req.adapter_id)

