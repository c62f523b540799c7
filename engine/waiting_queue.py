"""The scheduler's queue of requests waiting to run, one FIFO per adapter (per tenant), and the order in
which the scheduler offers them a place.

Policies (`SchedulerConfig.scheduling_policy`):
  "fair" (default): the adapter with the fewest running requests goes next (base-model requests count
          as one more adapter), ties by arrival. A tenant that sends a thousand requests at once takes a
          share of the batch, not all of it: another tenant's request runs as soon as a place frees.
  "fcfs": arrival order across all adapters (vLLM's default).
Preempted requests come before both, most recently preempted first: they already held a place.

Invariants: every waiting request is in exactly one FIFO (its adapter's) or in `preempted`; `seq` grows
with arrival, so a FIFO is sorted by it. The queue is not changed while an `order()` is iterated: the
scheduler removes the requests it admitted afterwards.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.request import Request, RequestStatus

POLICIES = ("fair", "fcfs")


class WaitingQueue:
    def __init__(self, policy: str = "fair"):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self._fifos: dict[int, deque[Request]] = {}     # adapter id -> its waiting requests, in arrival order
        self.preempted: deque[Request] = deque()
        self._seq: dict[int, int] = {}                  # id(request) -> arrival number
        self._next = itertools.count()

    def append(self, req: Request) -> None:
        self._seq[id(req)] = next(self._next)
        self._fifos.setdefault(req.adapter_id, deque()).append(req)

    def appendleft(self, req: Request) -> None:
        """A preempted request: before every other."""
        self._seq.setdefault(id(req), next(self._next))
        self.preempted.appendleft(req)

    def remove(self, req: Request) -> None:
        """Raises ValueError when `req` is not waiting."""
        if req in self.preempted:
            self.preempted.remove(req)
        else:
            fifo = self._fifos.get(req.adapter_id)
            if fifo is None:
                raise ValueError(f"request {req.request_id} is not waiting")
            fifo.remove(req)
            if not fifo:
                del self._fifos[req.adapter_id]
        del self._seq[id(req)]

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, req: Request) -> bool:
        return id(req) in self._seq

    def __iter__(self) -> Iterator[Request]:
        """Preempted requests, then the others in arrival order."""
        yield from self.preempted
        yield from heapq.merge(*self._fifos.values(), key=lambda r: self._seq[id(r)])

    def oldest(self) -> Request | None:
        """The request that has waited longest for a first place (a preempted one first)."""
        if self.preempted:
            return self.preempted[0]
        heads = [f[0] for f in self._fifos.values()]
        return min(heads, key=lambda r: self._seq[id(r)]) if heads else None

    def order(self, running: dict[int, int]) -> Iterator[Request]:
        """The waiting requests in the order they are offered a place. `running`: running requests per
        adapter id (updated here as offered requests start running). Under "fair", once an adapter's
        request is offered and not admitted, its later requests are not offered in this pass (they
        would be held back for the same reason)."""
        running = dict(running)
        for req in list(self.preempted):
            yield req
            if req.status == RequestStatus.RUNNING:
                running[req.adapter_id] = running.get(req.adapter_id, 0) + 1
        if self.policy == "fcfs":
            yield from heapq.merge(*self._fifos.values(), key=lambda r: self._seq[id(r)])
            return
        heap = [(running.get(aid, 0), self._seq[id(f[0])], aid, 0) for aid, f in self._fifos.items()]
        heapq.heapify(heap)
        while heap:
            _, _, aid, i = heapq.heappop(heap)
            fifo = self._fifos[aid]
            req = fifo[i]
            yield req
            if req.status != RequestStatus.RUNNING or i + 1 >= len(fifo):
                continue
            running[aid] = running.get(aid, 0) + 1
            heapq.heappush(heap, (running[aid], self._seq[id(fifo[i + 1])], aid, i + 1))
