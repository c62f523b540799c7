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


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
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
    assert ahead <= 3 if policy == "fair" else ahead >= 18
    while s.num_unfinished:
        fake_step(s)
    assert all(r.is_finished for r in flood) and s.kv.pool.num_free == 256
