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


def test_replicas_share_their_charges_so_a_limit_holds_across_them():
    """Two engines behind Ray Serve, each told the other's cumulative charges (as the Directory sums them):
    together they let in one minute's worth, not one each; the first exchange only sets a baseline."""
    clock = Clock()
    a, b = RateLimits(clock), RateLimits(clock)
    rate = RateLimit(requests_per_minute=4, tokens_per_minute=1000, requests=1, tokens=100)
    b.absorb({"acme": {"requests_per_minute": 50.0}})      # b's first exchange: what ran before it is past
    admit(a, "acme", rate)
    admit(a, "acme", rate)
    admit(b, "acme", rate)
    assert a.charged_table() == {"acme": {"requests_per_minute": 2.0, "tokens_per_minute": 200.0}}
    a.absorb(b.charged_table())                            # a's baseline: b's one request is not taken
    a.absorb({"acme": {"requests_per_minute": 1.0, "tokens_per_minute": 100.0}})    # unchanged: nothing
    b.absorb({"acme": {"requests_per_minute": 52.0, "tokens_per_minute": 200.0}})   # a's two since
    admit(b, "acme", rate)                                 # 4 - 1 - 2 = 1 left in b's bucket
    with pytest.raises(RateRefusal, match="requests_per_minute"):
        b.check("acme", rate)
    a.absorb(b.charged_table())                            # b's second one (after a's baseline)
    admit(a, "acme", rate)                                 # 4 - 2 (its own) - 1 = 1 left
    with pytest.raises(RateRefusal):
        a.check("acme", rate)
    a.absorb({"acme": {"requests_per_minute": 1.0}})       # lower (the Directory restarted): no refund
    with pytest.raises(RateRefusal):
        a.check("acme", rate)
    clock.now += 15.0                                      # one request's refill
    admit(a, "acme", rate)


def test_charges_for_a_tenant_not_seen_here_yet_wait_for_its_first_request():
    clock = Clock()
    limits, rate = RateLimits(clock), RateLimit(requests_per_minute=3, requests=1)
    limits.absorb({})
    limits.absorb({"acme": {"requests_per_minute": 3.0}})    # acme's whole minute, spent on another replica
    clock.now += 10.0
    with pytest.raises(RateRefusal, match=r"retry in 10.0 s"):  # as if its bucket had been full 10 s ago
        limits.check("acme", rate)
    limits.absorb({"acme": {"requests_per_minute": 3.0}, "beta": {"requests_per_minute": 3.0}})
    clock.now += 61.0                                      # beta's pending charges are forgotten after a minute
    limits.absorb({"acme": {"requests_per_minute": 3.0}, "beta": {"requests_per_minute": 3.0}})
    for _ in range(3):
        admit(limits, "beta", rate)
