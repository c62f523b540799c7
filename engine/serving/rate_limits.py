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
process: an engine restart refills them, and behind Ray Serve (`--replicas N`) each replica's engine keeps
its own, so a tenant may reach its limits on each replica.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ipc.requests import RateLimit


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


class RateLimits:
    KINDS = (("requests_per_minute", "requests"), ("tokens_per_minute", "tokens"))

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.buckets: dict[tuple[str, str], _Bucket] = {}

    def _limits(self, tenant: str, rate: RateLimit):
        """(the limit's name, its per-minute figure, this request's cost, its bucket, refilled to now) per limit set."""
        now = self.clock()
        for limit, cost in self.KINDS:
            per_minute = getattr(rate, limit)
            if per_minute > 0:
                bucket = self.buckets.setdefault((tenant, limit), _Bucket(per_minute, now))
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
        for _, _, cost, bucket in self._limits(tenant, rate):
            bucket.level -= cost
