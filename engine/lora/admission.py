"""Adapter-aware admission for the scheduler.

Rules: at most `max_distinct` distinct adapters among running requests (base requests do not count):
`max_loras` when set (and a backend's slot count, if it has one); unset, the pool alone bounds it; a
request runs only once its adapter is resident in the pool (and, on the reference backend, holds a compute
slot). `can_admit` only answers; `hold` does what a refusal implies (counts, starts the load), and every
load starts in AdapterManager.start_load, which hands it to the loader. Requests whose
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

    def begin_pass(self) -> None:
        """A scheduler pass over the waiting queue starts: places in line are noted afresh (note_place)."""
        self.adapters.next_use = {}

    def note_place(self, req: Request, place: int) -> None:
        """req is `place`-th in line this pass: which queued adapters a load should evict last."""
        if req.adapter_id:
            self.adapters.next_use.setdefault(req.adapter_id, place)

    def can_admit(self, req: Request, freeze_new: bool) -> bool:
        """Whether `req` may start running now (a predicate: nothing changes)."""
        aid = req.adapter_id
        if not aid:
            return True
        if aid not in self.running and (self._capped() or freeze_new):
            return False
        if not self.adapters.is_resident(aid):
            return False
        return self.slots.has(aid) or self.slots.can_assign(set(self.running))

    def hold(self, req: Request, freeze_new: bool, may_load: bool) -> bool:
        """`req` could not start (can_admit was False): count why, and start its adapter's load if `may_load`
        (the scheduler allows loads only for requests that a free place awaits: a load for a request
        further back would evict adapters that the requests ahead of it are about to use). -> whether it
        waits for its adapter's load (in flight, or to be started when a place frees)."""
        aid = req.adapter_id
        if not aid:
            return False
        if aid not in self.running and (self._capped() or freeze_new):
            req.blocked_by_cap += 1
            return not self.adapters.is_resident(aid)
        if self.adapters.is_resident(aid):
            return False
        req.cold_start = True
        if req.load_wait_start is None:
            req.load_wait_start = time.monotonic()
        if may_load and not self.adapters.start_load(self.adapters.by_id[aid]):
            req.blocked_by_cap += 1      # the pool is full of running adapters and KV
        return True

    def _capped(self) -> bool:
        return self.max_distinct is not None and len(self.running) >= self.max_distinct

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

