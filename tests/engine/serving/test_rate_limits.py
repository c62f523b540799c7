"""engine/serving/rate_limits.py: a tenant's token buckets, on a controlled clock."""
import pytest

from engine.serving.rate_limits import RateLimits, RateRefusal
from ipc.requests import RateLimit


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admit(limits: RateLimits, tenant: str, rate: RateLimit) -> None:
    limits.check(tenant, rate)
    limits.charge(tenant, rate)


def test_a_minutes_burst_then_the_steady_rate():
    clock = Clock()
    limits, rate = RateLimits(clock), RateLimit(requests_per_minute=3, requests=1)
    for _ in range(3):
        admit(limits, "acme", rate)
    with pytest.raises(RateRefusal, match=r"tenant 'acme' is over its requests_per_minute \(3\); retry in 20.0 s") as e:
        limits.check("acme", rate)
    assert (e.value.status, e.value.retry_after) == (429, pytest.approx(20.0))
    clock.now += 19.0
    with pytest.raises(RateRefusal):
        limits.check("acme", rate)
    clock.now += 1.0                               # one request's refill: 60 s / 3
    admit(limits, "acme", rate)
    admit(limits, "beta", rate)                    # each tenant its own buckets
    limits.check("acme", None)                     # no limits, nothing kept
    limits.check("", rate)                         # no tenant (no keys configured)


def test_tokens_are_counted_and_a_request_larger_than_the_limit_never_fits():
    clock = Clock()
    limits = RateLimits(clock)
    admit(limits, "acme", RateLimit(tokens_per_minute=1000, tokens=700))
    with pytest.raises(RateRefusal, match="tokens_per_minute") as e:
        limits.check("acme", RateLimit(tokens_per_minute=1000, tokens=400))
    assert e.value.status == 429 and e.value.retry_after == pytest.approx(6.0)      # 100 tokens at 1000 a minute
    with pytest.raises(RateRefusal, match="needs 1001 tokens") as e:
        limits.check("acme", RateLimit(tokens_per_minute=1000, tokens=1001))
    assert e.value.status == 400


def test_only_an_admitted_request_is_charged_and_both_limits_must_fit():
    clock = Clock()
    limits = RateLimits(clock)
    rate = RateLimit(requests_per_minute=2, tokens_per_minute=100, requests=1, tokens=60)
    limits.check("acme", rate)                     # checked, then refused for another reason: not charged
    admit(limits, "acme", rate)
    with pytest.raises(RateRefusal, match="tokens_per_minute"):           # 1 request left, 40 tokens
        limits.check("acme", rate)
    clock.now += 60.0
    admit(limits, "acme", rate)                    # refilled, never beyond a minute's worth
    with pytest.raises(RateRefusal):
        limits.check("acme", rate)
