import random

import pytest

from engine.page_pool import PageKind, PagePool


def test_allocate_and_free_round_trip():
    pool = PagePool(8)
    pages = pool.allocate(5, PageKind.KV)
    assert pool.num_free == 3 and pool.usage() == {"free": 3, "kv": 5, "adapter": 0}
    assert not pool.can_allocate(4)
    with pytest.raises(MemoryError):
        pool.allocate(4, PageKind.KV)
    pool.free(pages)
    assert pool.num_free == 8


def test_double_free_is_an_error():
    pool = PagePool(2)
    pages = pool.allocate(1, PageKind.ADAPTER)
    pool.free(pages)
    with pytest.raises(RuntimeError):
        pool.free(pages)


def test_cached_free_page_is_reused_then_evicted_lru():
    pool = PagePool(3)
    a, b = pool.allocate(2, PageKind.KV)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.free([a, b])              # b is released first (reverse order), so b is evicted first
    assert pool.lookup(b"ha") == a
    pool.touch(a)
    assert pool.ref_count[a] == 1 and pool.num_free == 2
    pool.allocate(2, PageKind.KV)  # takes the never-used page and b, dropping b's hash
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a


def test_random_churn_keeps_accounting_exact():
    rng = random.Random(0)
    pool = PagePool(50)
    held: list[list[int]] = []
    for step in range(2000):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 6)
            if pool.can_allocate(n):
                pages = pool.allocate(n, rng.choice([PageKind.KV, PageKind.ADAPTER]))
                if rng.random() < 0.3:
                    pool.cache(pages[0], f"h{step}".encode())
                held.append(pages)
        assert pool.num_free + sum(len(h) for h in held) == 50
    for h in held:
        pool.free(h)
    assert pool.num_free == 50 and sum(pool.ref_count) == 0
