from engine.request import FinishReason, RequestStatus
from tests.engine.builders import fake_step, make_request, make_scheduler


def run_to_end(s, limit=1000):
    finished = []
    for _ in range(limit):
        if not s.num_unfinished:
            return finished
        finished += fake_step(s)[1]
    raise AssertionError("scheduler did not finish")


def test_prefill_and_decode_share_a_step():
    s = make_scheduler(max_num_batched_tokens=32)
    a = make_request(prompt_len=8, max_tokens=5)
    s.add(a)
    fake_step(s)
    b = make_request(prompt_len=12, max_tokens=2, first_token=100)
    s.add(b)
    out, _ = fake_step(s)
    assert [r.request_id for r in out.requests] == [a.request_id, b.request_id]
    assert out.num_new_tokens == [1, 12]


def test_long_prompt_is_prefilled_in_chunks():
    s = make_scheduler(num_pages=64, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    r = make_request(prompt_len=50, max_tokens=1)
    s.add(r)
    chunks = []
    while not r.is_finished:
        out, _ = fake_step(s)
        chunks.append(out.num_new_tokens[0])
    assert chunks == [16, 16, 16, 2]
    assert r.output_token_ids == [7]


def test_token_budget_is_respected():
    s = make_scheduler(num_pages=200, max_num_batched_tokens=20)
    for _ in range(5):
        s.add(make_request(prompt_len=9, max_tokens=3))
    for _ in range(20):
        out, _ = fake_step(s)
        assert out.total_tokens <= 20


def test_pool_exhaustion_preempts_and_everyone_finishes():
    s = make_scheduler(num_pages=8, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(prompt_len=6, max_tokens=8, first_token=100 * i) for i in range(4)]
    for r in reqs:
        s.add(r)
    finished = run_to_end(s)
    assert len(finished) == 4 and s.num_preemptions > 0
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    assert s.kv.pool.num_free == 8


def test_requests_queue_when_max_num_seqs_is_reached():
    s = make_scheduler(max_num_seqs=2)
    reqs = [make_request(prompt_len=4, max_tokens=3, first_token=10 * i) for i in range(5)]
    for r in reqs:
        s.add(r)
    out, _ = fake_step(s)
    assert len(out.requests) == 2 and len(s.waiting) == 3
    assert len(run_to_end(s)) == 5


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(num_pages=32, block_size=4)
    a = make_request(prompt_len=10, max_tokens=1)
    s.add(a)
    run_to_end(s)
    b = make_request(prompt_len=10, max_tokens=1)
    s.add(b)
    out, _ = fake_step(s)
    assert out.num_new_tokens == [2] and b.num_cached_tokens == 8


def test_prefix_cache_is_keyed_by_adapter_and_salt():
    s = make_scheduler(num_pages=32, block_size=4)
    s.add(make_request(prompt_len=10, max_tokens=1, cache_salt="tenant-a"))
    run_to_end(s)
    for kw in ({"cache_salt": "tenant-b"}, {"cache_salt": "tenant-a", "adapter_id": 3}, {}):
        r = make_request(prompt_len=10, max_tokens=1, **kw)
        s.add(r)
        run_to_end(s)
        assert r.num_cached_tokens == 0, kw
    r = make_request(prompt_len=10, max_tokens=1, cache_salt="tenant-a")
    s.add(r)
    run_to_end(s)
    assert r.num_cached_tokens == 8


def test_finish_frees_a_waiting_or_running_request():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request(), make_request()
    s.add(a)
    s.add(b)
    fake_step(s)
    s.finish(b, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert a.status == b.status == RequestStatus.FINISHED
    assert s.num_unfinished == 0 and s.kv.pool.num_free == s.kv.pool.num_pages


# -- suspects of a failed step -------------------------------------------------------------------------

def test_suspects_of_a_failed_step_run_alone_until_each_samples_a_token():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    reqs = [make_request(prompt_len=6, max_tokens=6, first_token=100 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    fake_step(s)
    fake_step(s)
    failed = s.schedule()                             # the step the model fails on: every request in it
    assert len(failed.requests) == 3
    s.requeue_suspects(failed.requests)
    late = make_request(prompt_len=4, max_tokens=2, first_token=900)
    s.add(late)
    alone = []
    while any(r.suspect for r in reqs):
        out, _ = fake_step(s)
        assert len(out.requests) == 1 and out.requests[0].suspect is False   # alone, and cleared by its token
        alone.append(out.requests[0])
    assert sorted(r.request_id for r in alone) == sorted(r.request_id for r in reqs)
    assert all(len(r.output_token_ids) == 3 for r in reqs)   # no token lost, none twice (2 before, 1 alone)
    assert late.status == RequestStatus.WAITING              # nothing new was admitted meanwhile
    finished = run_to_end(s)
    assert len(finished) == 4 and all(len(r.output_token_ids) == 6 for r in reqs)
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_a_suspect_with_a_long_prompt_stays_alone_through_its_chunks():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    long, short = make_request(prompt_len=20, max_tokens=3), make_request(prompt_len=4, max_tokens=3, first_token=50)
    s.add(long)
    s.add(short)
    failed = s.schedule()
    s.requeue_suspects(failed.requests)
    steps = []
    while long.suspect or short.suspect:
        out, _ = fake_step(s)
        steps.append([(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens)])
    assert all(len(step) == 1 for step in steps)
    assert [n for step in steps for rid, n in step if rid == long.request_id] == [8, 8, 4]
