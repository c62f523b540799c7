"""The waiting queue's offer order: fair across adapters (tenants) or first come, first served."""
import pytest

from engine.request import RequestStatus
from engine.waiting_queue import WaitingQueue
from tests.engine.builders import fake_step, make_request, make_scheduler


def queue(policy, spec):
    """spec: adapter ids in arrival order -> (queue, requests)"""
    q = WaitingQueue(policy)
    reqs = [make_request(adapter_id=a) for a in spec]
    for r in reqs:
        q.append(r)
    return q, reqs


def offer(q, running=None, admit=lambda r: True):
    """The order of one pass, admitting (status RUNNING) the requests `admit` accepts."""
    seen = []
    for r in q.order(running or {}):
        seen.append(r)
        if admit(r):
            r.status = RequestStatus.RUNNING
    return seen


def test_fair_takes_turns_between_adapters_ties_by_arrival():
    q, (a1, a2, a3, b1, b2, base) = queue("fair", [1, 1, 1, 2, 2, 0])
    assert offer(q) == [a1, b1, base, a2, b2, a3]


def test_fair_serves_the_adapter_with_fewest_running_first():
    q, (a1, a2, b1) = queue("fair", [1, 1, 2])
    assert offer(q, running={1: 3})[:1] == [b1]


def test_fair_stops_offering_an_adapter_whose_request_was_not_admitted():
    q, (a1, a2, b1, b2) = queue("fair", [1, 1, 2, 2])
    assert offer(q, admit=lambda r: r.adapter_id == 2) == [a1, b1, b2]


def test_fcfs_is_arrival_order_and_preempted_requests_come_first():
    q, (a1, b1, a2) = queue("fcfs", [1, 2, 1])
    late = make_request(adapter_id=3)
    late.status = RequestStatus.PREEMPTED
    q.appendleft(late)
    assert offer(q) == [late, a1, b1, a2]
    assert list(q) == [late, a1, b1, a2] and q.oldest() is late


def test_remove_len_contains_oldest():
    q, (a1, b1, a2) = queue("fair", [1, 2, 1])
    assert len(q) == 3 and q.oldest() is a1
    q.remove(a1)
    assert a1 not in q and b1 in q and len(q) == 2 and q.oldest() is b1
    q.remove(b1)
    q.remove(a2)
    assert not q and q.oldest() is None and list(q) == []
    with pytest.raises(ValueError):
        q.remove(a2)
    with pytest.raises(ValueError, match="scheduling_policy"):
        WaitingQueue("lottery")


@pytest.mark.parametrize("policy", ["vtc", "fair", "fcfs"])
def test_a_flood_from_one_tenant_does_not_hold_up_another(policy):
    """Tenant 1 queues 20 requests, then tenant 2 one: with two places, fair scheduling runs tenant 2's as
    soon as a place frees; first come, first served makes it wait for all of tenant 1's."""
    s = make_scheduler(num_pages=256, max_num_seqs=2, scheduling_policy=policy)
    flood = [make_request(prompt_len=4, max_tokens=3, adapter_id=1) for _ in range(20)]
    for r in flood:
        s.add(r)
    fake_step(s)
    other = make_request(prompt_len=4, max_tokens=3, adapter_id=2)
    s.add(other)
    finished = []
    while not other.is_finished:
        finished += fake_step(s)[1]
    ahead = sum(r in finished for r in flood)     # fair: the two running, and the one admitted with it
    assert ahead <= 3 if policy in ("vtc", "fair") else ahead >= 18
    while s.num_unfinished:
        fake_step(s)
    assert all(r.is_finished for r in flood) and s.kv.pool.num_free == 256


def served_tokens(policy: str, steps: int = 60, long: int = 48, short: int = 4, count: int = 100,
                  **cfg) -> dict[str, float]:
    """Two backlogged tenants, one with long prompts and one with short ones, two places: the weighted
    tokens (VTC's W_IN per prompt token, W_OUT per output token) each was served in `steps` steps."""
    cfg = {"num_pages": 1024, "max_num_seqs": 2, "max_num_batched_tokens": 64, **cfg}
    s = make_scheduler(scheduling_policy=policy, **cfg)
    for i in range(count):                # more than either can be served in `steps`: both stay backlogged
        s.add(make_request(prompt_len=long, max_tokens=2, tenant="long", adapter_id=1, first_token=i))
        s.add(make_request(prompt_len=short, max_tokens=2, tenant="short", adapter_id=2, first_token=i))
    served = {"long": 0.0, "short": 0.0}
    for _ in range(steps):
        before = {id(r): (r.num_computed_tokens, len(r.output_token_ids)) for r in s.running}
        out, _ = fake_step(s)
        for r, n in zip(out.requests, out.num_new_tokens):
            computed, outputs = before.get(id(r), (0, 0))
            served[r.tenant] += 1.0 * max(0, min(n, r.num_prompt_tokens - computed))   # prompt tokens
            served[r.tenant] += 2.0 * (len(r.output_token_ids) - outputs)              # generated tokens
    return served


def test_vtc_shares_served_tokens_not_places():
    """Counting places (fair) gives the long-prompt tenant most of the work; counting served tokens (VTC)
    keeps the two within a request's worth of each other."""
    vtc, fair = served_tokens("vtc"), served_tokens("fair")
    assert fair["long"] > 3 * fair["short"], fair
    assert abs(vtc["long"] - vtc["short"]) <= 60 and min(vtc.values()) > 100, vtc


def test_vtc_charges_every_prefill_chunk():
    """4,000-token prompts prefilled 128 tokens a step against 50-token ones, 16 places: every chunk is
    charged, so the served weighted tokens stay within 10% (charging only the first chunk gave the long
    tenant several times the short one's)."""
    served = served_tokens("vtc", steps=600, long=4000, short=50, count=3000, num_pages=8192, block_size=16,
                           max_num_seqs=16, max_num_batched_tokens=512, long_prefill_token_threshold=128)
    assert min(served.values()) > 4000, served
    assert abs(served["long"] - served["short"]) <= 0.1 * max(served.values()), served


def test_vtc_gives_no_credit_for_idle_time():
    """A tenant arriving idle starts at the least counter among the active ones, not at zero."""
    from engine.waiting_queue import VtcPolicy
    p = VtcPolicy()
    busy = make_request(tenant="busy")
    p.on_arrival(busy)
    p.on_prompt_scheduled(busy, 500)
    late = make_request(tenant="late")
    p.on_arrival(late)
    assert p.counter["late"] == p.counter["busy"] == 500
    p.on_leave(busy)
    p.on_leave(late)
    again = make_request(tenant="busy")
    p.on_arrival(again)                    # nobody else active: keeps its own counter
    assert p.counter["busy"] == 500


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_tenants_on_one_adapter_get_their_share(policy):
    """Two tenants on the base model (one adapter): under VTC the late tenant's request runs as soon as a
    place frees, under fcfs after the flood."""
    s = make_scheduler(num_pages=256, max_num_seqs=2, scheduling_policy=policy)
    flood = [make_request(prompt_len=4, max_tokens=3, tenant="a") for _ in range(20)]
    for r in flood:
        s.add(r)
    fake_step(s)
    other = make_request(prompt_len=4, max_tokens=3, tenant="b")
    s.add(other)
    finished = []
    while not other.is_finished:
        finished += fake_step(s)[1]
    ahead = sum(r in finished for r in flood)
    assert ahead <= 3 if policy == "vtc" else ahead >= 18
    while s.num_unfinished:
        fake_step(s)
