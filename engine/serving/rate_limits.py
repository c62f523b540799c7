"""Tenants' rate limits (`requests_per_minute`, `tokens_per_minute` in the config's [[auth.tenants]]): token
buckets kept by the engine, which sees every frontend's requests.

Each limited tenant has a bucket per limit, holding up to the per-minute figure and refilled continuously at
that figure a minute (a burst of a whole minute's worth, then the steady rate). A request's cost comes with
it (ipc.requests.RateLimit): 1 request, and its prompt plus the tokens it may generate (max_tokens, or the
rest of the context) times its choices, the way OpenAI counts a request against a token limit. It is let in
when every bucket holds its cost, and charged once admitted (a request refused for another reason, e.g. an
unknown adapter, costs nothing); otherwise it is refused with the seconds until it would fit. Requests
checked while an adapter of an earlier one loads may all pass before that one is charged, so a bucket may
dip below zero by such overlap; later requests then wait for it to refill. Buckets live in the engine
process: an engine restart refills them.

Behind Ray Serve (`--replicas N`) each replica's engine keeps buckets too, and the replicas share what they
charge: twice a second each replica takes its engine's own charges (`charged`) to the application's
Directory and gives its engine the other engines' (`absorb`, cumulative, as the Directory sums them), so
every bucket also pays for what the tenant ran elsewhere. A tenant's limits then hold across the replicas,
up to what they admit within about a second (the time a charge takes to reach the others). Charges for a
tenant an engine has no bucket for yet are kept PENDING_S seconds and replayed into its bucket when its
first request comes; an engine's first exchange only sets where it starts counting (what ran before it
started is past).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ipc.requests import RateLimit

PENDING_S = 60.0      # how long other replicas' charges wait for a tenant's first request here (a full refill)


class RateRefusal(Exception):
    """Why a request may not run now: `status` 429 (retry after `retry_after` seconds) or 400 (it never fits);
    `limit`: which ("requests_per_minute" or "tokens_per_minute")."""

    def __init__(self, message: str, status: int, limit: str, retry_after: float = 0.0):
        super().__init__(message)
        self.status, self.limit, self.retry_after = status, limit, retry_after


class _Bucket:
    def __init__(self, per_minute: int, now: float):
        self.per_minute, self.level, self.at = per_minute, float(per_minute), now

    def refill(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute                  # a changed limit applies from now on
        self.level = min(float(per_minute), self.level + (now - self.at) * per_minute / 60.0)
        self.at = now

    def wait(self, cost: int) -> float:
        """Seconds until the bucket holds `cost` (0: now)."""
        return max(0.0, (cost - self.level) * 60.0 / self.per_minute)

    def replay(self, charges: list[tuple[float, float]]) -> None:
        """Charges (time, units), oldest first, made before this bucket existed: as if it had been full then."""
        if charges:
            self.level, self.at = float(self.per_minute), charges[0][0]
        for at, units in charges:
            level = min(float(self.per_minute), self.level + (at - self.at) * self.per_minute / 60.0) - units
            self.level, self.at = max(level, -float(self.per_minute)), at


class RateLimits:
    KINDS = (("requests_per_minute", "requests"), ("tokens_per_minute", "tokens"))

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.buckets: dict[tuple[str, str], _Bucket] = {}
        self.charged: dict[tuple[str, str], float] = {}     # (tenant, limit) -> units charged here, cumulative
        self._seen: dict[tuple[str, str], float] | None = None       # others' cumulative charges taken (None: never)
        self._pending: dict[tuple[str, str], list[tuple[float, float]]] = {}   # others' (time, units), no bucket yet

    def _limits(self, tenant: str, rate: RateLimit):
        """(the limit's name, its per-minute figure, this request's cost, its bucket, refilled to now) per limit set."""
        now = self.clock()
        for limit, cost in self.KINDS:
            per_minute = getattr(rate, limit)
            if per_minute > 0:
                bucket = self.buckets.get((tenant, limit))
                if bucket is None:
                    bucket = self.buckets[(tenant, limit)] = _Bucket(per_minute, now)
                    bucket.replay(self._pending.pop((tenant, limit), []))
                bucket.refill(per_minute, now)
                yield limit, per_minute, getattr(rate, cost), bucket

    def check(self, tenant: str, rate: RateLimit | None) -> None:
        """RateRefusal unless `tenant`'s buckets hold this request's cost now (nothing is charged)."""
        if rate is None or not tenant:
            return
        for limit, per_minute, cost, bucket in self._limits(tenant, rate):
            if cost > per_minute:
                raise RateRefusal(f"this request needs {cost} tokens (its prompt and max_tokens, or the rest of "
                                  f"the context without one, times n), more than the {limit} of tenant {tenant!r} "
                                  f"({per_minute}): set a lower max_tokens", 400, limit)
            wait = bucket.wait(cost)
            if wait > 0:
                raise RateRefusal(f"tenant {tenant!r} is over its {limit} ({per_minute}); retry in "
                                  f"{wait:.1f} s", 429, limit, wait)

    def charge(self, tenant: str, rate: RateLimit | None) -> None:
        """Take an admitted request's cost from `tenant`'s buckets."""
        if rate is None or not tenant:
            return
        for limit, _, cost, bucket in self._limits(tenant, rate):
            bucket.level -= cost
            self.charged[(tenant, limit)] = self.charged.get((tenant, limit), 0.0) + cost

    def charged_table(self) -> dict[str, dict[str, float]]:
        """What this engine has charged since it started: {tenant: {limit: units}} (RateSyncReply)."""
        out: dict[str, dict[str, float]] = {}
        for (tenant, limit), units in self.charged.items():
            out.setdefault(tenant, {})[limit] = units
        return out

    def absorb(self, others: dict[str, dict[str, float]]) -> None:
        """The other replicas' charges, cumulative ({tenant: {limit: units}}, a RateSync): what grew since the
        last call is taken from the buckets here (or kept for a tenant without one yet), a bucket owing one
        minute's worth at most. The first call sets the baseline; a figure lower than one seen before (the
        Directory restarted) is not a refund."""
        now = self.clock()
        flat = {(t, limit): float(units) for t, by in others.items() for limit, units in by.items()}
        if self._seen is None:
            self._seen = flat
            return
        for key, units in flat.items():
            grown = units - self._seen.get(key, 0.0)
            if grown <= 0:
                continue
            self._seen[key] = units
            bucket = self.buckets.get(key)
            if bucket is not None:
                bucket.refill(bucket.per_minute, now)
                bucket.level = max(bucket.level - grown, -float(bucket.per_minute))     # owes a minute at most
            else:
                self._pending.setdefault(key, []).append((now, grown))
        for key in list(self._pending):
            self._pending[key] = [(at, u) for at, u in self._pending[key] if now - at < PENDING_S]
            if not self._pending[key]:
                del self._pending[key]
