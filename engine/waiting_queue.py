"""The scheduler's queue of requests waiting to run, one FIFO per tenant and adapter, and the order in
which the scheduler offers them a place.

Policies (`SchedulerConfig.scheduling_policy`), each a class of its own, chosen by name in `POLICIES`:
  "vtc" (default): virtual token counters over tenants (adapters without tenants): the one served the
          fewest weighted tokens goes next (VtcPolicy).
  "fair": the adapter with the fewest running requests goes next (base-model requests count
          as one more adapter), ties by arrival. A tenant that sends a thousand requests at once takes a
          share of the batch, not all of it: another tenant's request runs as soon as a place frees.
  "fcfs": arrival order across all adapters (vLLM's default).
Preempted requests come before both, most recently preempted first: they already held a place.

Invariants: every waiting request is in exactly one FIFO (its tenant's and adapter's) or in `preempted`; `seq` grows
with arrival, so a FIFO is sorted by it. The queue is not changed while an `order()` is iterated: the
scheduler removes the requests it admitted afterwards.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from engine.request import Request, RequestStatus

Fifos = dict[tuple[str, int], deque[Request]]   # (tenant, adapter id) -> its waiting requests, in arrival order


def _fifo_key(req: Request) -> tuple[str, int]:
    return req.tenant, req.adapter_id


class Policy(ABC):
    """The order in which waiting requests (not the preempted ones) are offered a place. The hooks tell a
    policy that keeps accounts what happened: a request arrived, had a chunk of its prompt scheduled,
    produced tokens, or left (finished or aborted)."""
    name = ""

    def on_arrival(self, req: Request) -> None:
        pass

    def on_prompt_scheduled(self, req: Request, prompt_tokens: int) -> None:
        pass

    def on_generated(self, req: Request, tokens: int) -> None:
        pass

    def on_leave(self, req: Request) -> None:
        pass

    @abstractmethod
    def order(self, fifos: Fifos, seq: dict[int, int], running: dict[int, int]) -> Iterator[Request]:
        """fifos: the queue's FIFOs; seq: id(request) -> arrival number; running: running requests per
        adapter id (a private copy: update it as offered requests start running)."""


class FcfsPolicy(Policy):
    """Arrival order across all adapters (vLLM's default)."""
    name = "fcfs"

    def order(self, fifos, seq, running):
        yield from heapq.merge(*fifos.values(), key=lambda r: seq[id(r)])


class FairPolicy(Policy):
    """The adapter with the fewest running requests goes next, ties by arrival. Once an adapter's request
    is offered and not admitted, its later requests are not offered in this pass (they would be held back
    for the same reason)."""
    name = "fair"

    def order(self, fifos, seq, running):
        heap = [(running.get(f[0].adapter_id, 0), seq[id(f[0])], key, 0) for key, f in fifos.items()]
        heapq.heapify(heap)
        while heap:
            _, _, key, i = heapq.heappop(heap)
            fifo = fifos[key]
            req = fifo[i]
            yield req
            if req.status != RequestStatus.RUNNING or i + 1 >= len(fifo):
                continue
            aid = req.adapter_id
            running[aid] = running.get(aid, 0) + 1
            heapq.heappush(heap, (running[aid], seq[id(fifo[i + 1])], key, i + 1))


def fair_key(req: Request) -> str | int:
    """Whom fairness is between: the request's tenant, or its adapter where no tenants are configured."""
    return req.tenant or req.adapter_id


class VtcPolicy(Policy):
    """Virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24), over
    tenants (adapters when no tenants are configured): the one served the fewest weighted tokens goes
    next. Each prefill chunk scheduled adds W_IN per prompt token in it, each generated token W_OUT. A tenant arriving
    idle (nothing waiting or running) starts at the least counter among the active ones: idle time earns
    no credit, and a newcomer never starts ahead of everyone. Ties by arrival; once a tenant's request is
    offered and not admitted, its later requests are not offered in this pass."""
    name = "vtc"
    W_IN, W_OUT = 1.0, 2.0

    def __init__(self):
        self.counter: dict[str | int, float] = {}
        self.active: dict[str | int, int] = {}      # key -> its requests waiting or running

    def on_arrival(self, req: Request) -> None:
        k = fair_key(req)
        if not self.active.get(k):
            floor = min((self.counter.get(a, 0.0) for a in self.active), default=self.counter.get(k, 0.0))
            self.counter[k] = max(self.counter.get(k, 0.0), floor)
        self.active[k] = self.active.get(k, 0) + 1

    def on_prompt_scheduled(self, req: Request, prompt_tokens: int) -> None:
        k = fair_key(req)
        self.counter[k] = self.counter.get(k, 0.0) + self.W_IN * prompt_tokens

    def on_generated(self, req: Request, tokens: int) -> None:
        k = fair_key(req)
        self.counter[k] = self.counter.get(k, 0.0) + self.W_OUT * tokens

    def on_leave(self, req: Request) -> None:
        k = fair_key(req)
        n = self.active.get(k, 0) - 1
        if n > 0:
            self.active[k] = n
        else:
            self.active.pop(k, None)

    def order(self, fifos, seq, running):
        heap = [(self.counter.get(fair_key(f[0]), 0.0), seq[id(f[0])], aid, 0) for aid, f in fifos.items()]
        heapq.heapify(heap)
        blocked: set[str | int] = set()
        while heap:
            c, s, aid, i = heapq.heappop(heap)
            fifo = fifos[aid]
            req = fifo[i]
            k = fair_key(req)
            if k in blocked:
                continue
            now = self.counter.get(k, 0.0)
            if now != c:                                  # served since it was pushed: take its place again
                heapq.heappush(heap, (now, s, aid, i))
                continue
            yield req
            if req.status != RequestStatus.RUNNING:
                blocked.add(k)
            elif i + 1 < len(fifo):
                heapq.heappush(heap, (self.counter.get(k, 0.0), seq[id(fifo[i + 1])], aid, i + 1))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (VtcPolicy, FairPolicy, FcfsPolicy)}


def policy_class(name: str) -> type[Policy]:
    """The policy called `name`; ValueError naming the choices otherwise."""
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]


class WaitingQueue:
    def __init__(self, policy: str = "vtc"):
        self.policy = policy_class(policy)()
        # (tenant, adapter id) -> its waiting requests, in arrival order
        self._fifos: dict[tuple[str, int], deque[Request]] = {}
        self.preempted: deque[Request] = deque()
        self._seq: dict[int, int] = {}                  # id(request) -> arrival number
        self._next = itertools.count()

    def append(self, req: Request) -> None:
        """A new request (the policy sees it arrive)."""
        self.policy.on_arrival(req)
        self._seq[id(req)] = next(self._next)
        self._fifos.setdefault(_fifo_key(req), deque()).append(req)

    def appendleft(self, req: Request) -> None:
        """A preempted request: before every other."""
        self._seq.setdefault(id(req), next(self._next))
        self.preempted.appendleft(req)

    def remove(self, req: Request) -> None:
        """Raises ValueError when `req` is not waiting."""
        if req in self.preempted:
            self.preempted.remove(req)
        else:
            fifo = self._fifos.get(_fifo_key(req))
            if fifo is None:
                raise ValueError(f"request {req.request_id} is not waiting")
            fifo.remove(req)
            if not fifo:
                del self._fifos[_fifo_key(req)]
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
        """The waiting requests in the order they are offered a place: the preempted ones, then the
        policy's order. `running`: running requests per adapter id (not changed here)."""
        running = dict(running)
        for req in list(self.preempted):
            yield req
            if req.status == RequestStatus.RUNNING:
                running[req.adapter_id] = running.get(req.adapter_id, 0) + 1
        yield from self.policy.order(self._fifos, self._seq, running)
