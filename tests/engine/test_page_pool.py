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


def walked_usage(pool: PagePool) -> dict[str, int]:
    """usage() the slow way: every page's kind (free when no one holds it)."""
    counts = {k.value: 0 for k in PageKind}
    for i in range(pool.num_pages):
        counts[(PageKind.FREE if pool.ref_count[i] == 0 else pool.kind[i]).value] += 1
    return counts


def test_random_churn_keeps_accounting_exact():
    """Allocations, frees, cached blocks taken again from the free queue or shared while held: the free
    count and usage() (kept as pages change hands) always agree with a walk over every page."""
    rng = random.Random(0)
    pool = PagePool(50)
    held: list[list[int]] = []
    for step in range(2000):
        r = rng.random()
        if held and r < 0.45:
            pool.free(held.pop(rng.randrange(len(held))))
        elif r < 0.6 and pool.hash_to_page:
            page = pool.lookup(rng.choice(sorted(pool.hash_to_page)))
            pool.touch(page)                         # a prefix hit: from the free queue or shared
            held.append([page])
        else:
            n = rng.randint(1, 6)
            if pool.can_allocate(n):
                pages = pool.allocate(n, rng.choice([PageKind.KV, PageKind.ADAPTER]))
                if rng.random() < 0.3:
                    pool.cache(pages[0], f"h{step}".encode())
                held.append(pages)
        assert pool.num_free + len({p for h in held for p in h}) == 50
        assert pool.usage() == walked_usage(pool)
    for h in held:
        pool.free(h)
    assert pool.num_free == 50 and sum(pool.ref_count) == 0
    assert pool.usage() == {"free": 50, "kv": 0, "adapter": 0}
