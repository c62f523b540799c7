"""The adapter tiers over the unified page pool: loads, LRU eviction, pinning, unregister, churn."""
import random

import pytest
import torch

from engine.config import LoraConfig
from engine.lora.adapter_manager import AdapterManager, AdapterState
from engine.lora.host_adapter import load_host_adapter
from engine.page_pool import PageKind, PagePool
from kernels.lora_layout import unpack_module
from tests.engine.lora.synthetic import TINY, write_adapter

PAGE = 512


def manager(num_pages, **cfg):
    pool = PagePool(num_pages)
    storage = torch.zeros(num_pages, PAGE)
    return AdapterManager(LoraConfig(**cfg), TINY, pool, storage), pool


def load(m, a):
    assert m.start_load(a)
    m.wait_loads()
    assert not m.poll()
    assert a.state == AdapterState.RESIDENT


def test_pages_hold_the_weights_without_rank_padding(tmp_path):
    m, pool = manager(64)
    a = m.register("a", write_adapter(tmp_path / "a", r=3, targets=("q_proj", "down_proj")))
    load(m, a)
    assert a.layout.num_elems == 2 * (3 * (32 + 32) + 3 * (64 + 32))
    assert len(a.pages) == -(-a.layout.num_elems // PAGE)
    flat = m.storage[torch.tensor(a.pages)].flatten()
    m.settle()                                                     # packed in place: the host copy comes after
    assert torch.equal(m.host[a.adapter_id].flatten(), flat)       # the host tier holds the packed pages
    host = load_host_adapter(a.path, m.model, 64)
    for key, s in a.layout.modules.items():
        A, B = unpack_module(flat, s)
        assert torch.equal(A, host.modules[key].a) and torch.equal(B, host.modules[key].b)
    assert pool.usage()["adapter"] == len(a.pages)


def test_lru_eviction_spares_active_and_pinned(tmp_path):
    m, pool = manager(6)
    ads = [m.register(n, write_adapter(tmp_path / n, r=4, seed=i)) for i, n in enumerate("abc")]
    assert ads[0].layout.num_pages(PAGE) == 2
    for a in ads:
        load(m, a)
    m.enqueue(ads[0].adapter_id)
    m.acquire(ads[0].adapter_id)              # a is running
    d = m.register("d", write_adapter(tmp_path / "d", r=4, seed=9))
    load(m, d)                                # evicts b (least recent idle), not a
    assert ads[1].state == AdapterState.DISK and ads[0].state == AdapterState.RESIDENT
    assert m.stats.evictions == 1
    m.release(ads[0].adapter_id)
    m.dequeue(ads[0].adapter_id)
    p1 = m.register("p1", write_adapter(tmp_path / "p1", r=4, seed=3), pinned=True)
    p2 = m.register("p2", write_adapter(tmp_path / "p2", r=4, seed=4), pinned=True)
    m.wait_loads()
    m.poll()
    assert p1.state == p2.state == AdapterState.RESIDENT
    with pytest.raises(ValueError, match="pinning"):      # would leave no room for one more adapter
        m.register("p3", write_adapter(tmp_path / "p3", r=4, seed=5), pinned=True)
    assert m.evict_idle(100) == 2 and p1.pages and p2.pages  # only the unpinned idle one goes


def test_unregister_waits_for_requests_then_frees_everything(tmp_path):
    m, pool = manager(16)
    a = m.register("a", write_adapter(tmp_path / "a", r=4))
    load(m, a)
    m.enqueue(a.adapter_id)
    m.acquire(a.adapter_id)
    m.unregister("a")
    assert "a" not in m.by_name and a.pages            # still in use: kept
    with pytest.raises(KeyError):
        m.lookup("a")
    m.release(a.adapter_id)
    m.dequeue(a.adapter_id)
    assert not a.pages and pool.num_free == 16 and a.adapter_id not in m.by_id and not m.host


def test_ten_thousand_random_cycles_keep_accounting_exact(tmp_path):
    rng = random.Random(0)
    dirs = [write_adapter(tmp_path / f"src{i}", r=rng.choice([1, 2, 4, 8, 16]), seed=i,
                          targets=rng.choice([("q_proj",), ("q_proj", "v_proj"), ("gate_proj", "down_proj")]))
            for i in range(12)]
    m, pool = manager(40, max_cpu_loras=4)
    kv_blocks: list[list[int]] = []
    running: list[int] = []
    for step in range(10_000):
        op = rng.random()
        names = list(m.by_name)
        if op < 0.15 or not names:
            m.register(f"n{rng.randrange(20)}", rng.choice(dirs), pinned=False)
        elif op < 0.25:
            m.unregister(rng.choice(names))
        elif op < 0.55:
            a = m.lookup(rng.choice(names))
            need = a.layout.num_pages(PAGE)
            enough = pool.num_free + sum(len(x.pages) for x in m.by_id.values() if m.evictable(x)) >= need
            ok = m.start_load(a)
            assert ok or not enough, "load refused while enough pages were free or evictable"
            m.wait_loads()
            assert not m.poll()
            if ok and rng.random() < 0.5:
                m.enqueue(a.adapter_id)
                m.acquire(a.adapter_id)
                running.append(a.adapter_id)
        elif op < 0.75 and running:
            aid = running.pop(rng.randrange(len(running)))
            m.release(aid)
            m.dequeue(aid)
        elif op < 0.9:
            n = rng.randint(1, 4)
            if not pool.can_allocate(n):
                m.evict_idle(n - pool.num_free)
            if pool.can_allocate(n):
                kv_blocks.append(pool.allocate(n, PageKind.KV))
        elif kv_blocks:
            pool.free(kv_blocks.pop(rng.randrange(len(kv_blocks))))
        held = sum(len(a.pages) for a in m.by_id.values())
        assert pool.num_free + held + sum(map(len, kv_blocks)) == pool.num_pages, step
        if step % 50 == 0:
            assert m.tiers() == _recount_tiers(m) and m.tier_bytes() == _recount_bytes(m), step
        assert len(m.host) <= 4
    for aid in running:
        m.release(aid)
        m.dequeue(aid)
    for name in list(m.by_name):
        m.unregister(name)
    for blocks in kv_blocks:
        pool.free(blocks)
    assert pool.num_free == pool.num_pages and sum(pool.ref_count) == 0
    assert not m.by_id and not m.host and not m.lru
    assert m.stats.loads > 100 and m.stats.evictions > 100


def _recount_tiers(m):
    states = [a.state for a in m.by_id.values()]
    return {"resident": states.count(AdapterState.RESIDENT), "loading": states.count(AdapterState.LOADING),
            "host": len(m.host), "registered": len(m.by_name)}


def _recount_bytes(m):
    page_bytes = PAGE * m.storage.element_size()
    return {"pool": sum(len(a.pages) for a in m.by_id.values()) * page_bytes, "host": m.host.nbytes,
            "disk": sum(a.files.nbytes for a in {id(a): a for a in m.by_name.values()}.values())}


class _Unwalkable(dict):
    """A registry that fails a test which walks it."""
    def values(self):
        raise AssertionError("walked every registered adapter")

    items = keys = __iter__ = values


def test_a_step_walks_the_loads_in_flight_never_the_registry(tmp_path):
    m, pool = manager(64)
    ads = [m.register(f"a{i}", write_adapter(tmp_path / f"a{i}", r=4, seed=i)) for i in range(6)]
    m.loader.pause()
    assert m.start_load(ads[1]) and m.start_load(ads[4])
    assert list(m.in_flight) == [ads[1].adapter_id, ads[4].adapter_id]
    registry, m.by_id = m.by_id, _Unwalkable(m.by_id)      # what a step calls must not walk it
    assert not m.poll() and m.loading() and m.tiers()["loading"] == 2
    m.finish_small_loads()                         # waits up to 4 ms for the paused loads: walks in_flight
    m.loader.resume()
    m.wait_loads()
    assert not m.poll() and not m.in_flight and not m.loading()
    assert ads[1].state == ads[4].state == AdapterState.RESIDENT and ads[0].state == AdapterState.DISK
    m.tier_bytes()
    m.by_id = registry
    assert m.tiers() == _recount_tiers(m) and m.tier_bytes() == _recount_bytes(m)


def test_a_prefetch_leaves_its_reserve_free_and_evicts_nothing_when_it_cannot_fit(tmp_path):
    m, pool = manager(6)
    a, b = (m.register(n, write_adapter(tmp_path / n, r=4, seed=i)) for i, n in enumerate("ab"))
    load(m, a)                                                 # idle, no request needs it: 2 of 6 pages
    assert not m.start_load(b, evict_queued=False, reserve=5)  # 2 + 5 > 6 even without a: a stays
    assert a.state == AdapterState.RESIDENT and m.stats.evictions == 0 and b.state == AdapterState.DISK
    assert m.start_load(b, evict_queued=False, reserve=3)      # fits once a goes: 6 - 2 >= 3
    m.wait_loads()
    m.poll()
    assert b.state == AdapterState.RESIDENT and a.state == AdapterState.DISK and pool.num_free == 4


def test_queued_adapters_are_evicted_furthest_back_in_line_first(tmp_path):
    m, pool = manager(6)
    ads = [m.register(n, write_adapter(tmp_path / n, r=4, seed=i)) for i, n in enumerate("abc")]
    for a in ads:
        load(m, a)
        m.enqueue(a.adapter_id)                                # each waits for a request in line
    m.next_use = {ads[0].adapter_id: 0, ads[2].adapter_id: 5}  # b was not reached: further back still
    d = m.register("d", write_adapter(tmp_path / "d", r=4, seed=9))
    assert m.start_load(d)                                     # evicts b (unknown place: furthest back)
    assert [a.state for a in ads] == [AdapterState.RESIDENT, AdapterState.DISK, AdapterState.RESIDENT]
    m.wait_loads()
    m.poll()
    m.enqueue(d.adapter_id)
    m.next_use[d.adapter_id] = 1
    e = m.register("e", write_adapter(tmp_path / "e", r=4, seed=10))
    assert m.start_load(e)                                     # c (place 5) before d (1) and a (0)
    assert [a.state for a in ads] == [AdapterState.RESIDENT, AdapterState.DISK, AdapterState.DISK]
    assert d.state == AdapterState.RESIDENT


def test_registering_reads_no_weights_the_load_does(tmp_path, monkeypatch):
    import engine.lora.loader as loader
    m, pool = manager(16)
    d = write_adapter(tmp_path / "a", r=4)
    calls = []
    real = loader._pack_from_file                      # the one pass over the file, whichever way it packs
    # (only this folder's: a loader thread an earlier test left running may pack its own adapter meanwhile)
    def counted(files, *args, **kwargs):
        if files.path == d:
            calls.append(files.path)
        return real(files, *args, **kwargs)
    monkeypatch.setattr(loader, "_pack_from_file", counted)
    a = m.register("a", d)
    assert not calls and a.state == AdapterState.DISK and pool.num_free == 16
    load(m, a)
    assert calls == [d]


def test_a_load_racing_an_unload_frees_everything_when_it_lands(tmp_path):
    m, pool = manager(16)
    a = m.register("a", write_adapter(tmp_path / "a", r=4))
    m.loader.pause()
    assert m.start_load(a) and a.state == AdapterState.LOADING
    m.unregister("a")                                  # refused for new requests at once
    assert "a" not in m.by_name and a.pages           # the loader still writes its pages: kept until it lands
    assert m.evict_idle(16) == 0
    m.loader.resume()
    m.wait_loads()
    assert not m.poll()
    assert pool.num_free == 16 and a.adapter_id not in m.by_id and not m.host and not m.in_flight


def test_a_reload_under_the_same_name_while_loading_serves_the_new_weights(tmp_path):
    m, pool = manager(16)
    old = m.register("a", write_adapter(tmp_path / "old", r=4, seed=1))
    m.enqueue(old.adapter_id)                         # a request admitted for the old weights
    m.loader.pause()
    assert m.start_load(old)
    new = m.register("a", write_adapter(tmp_path / "new", r=4, seed=2))
    assert m.lookup("a") is new and new.adapter_id != old.adapter_id
    assert m.start_load(new)
    m.loader.resume()
    m.wait_loads()
    assert not m.poll()
    assert old.state == new.state == AdapterState.RESIDENT      # the old one until its request is done
    assert not torch.equal(m.storage[old.pages], m.storage[new.pages])
    m.dequeue(old.adapter_id)
    assert old.adapter_id not in m.by_id and pool.num_free == 16 - len(new.pages)


def test_a_load_that_fails_frees_its_pages_and_names_the_problem(tmp_path):
    m, pool = manager(16)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    d = write_adapter(tmp_path / "a", 4, extra_tensors={key: torch.full((16, 4), float("nan"))})
    a = m.register("a", d)                      # registration reads no weights: the load finds the NaN
    assert m.start_load(a)
    m.wait_loads()
    (failed, error), = m.poll()
    assert failed is a and "NaN" in error and "v_proj" in error
    assert a.state == AdapterState.DISK and pool.num_free == 16 and m.stats.failed_loads == 1 and not m.in_flight
    b = m.register("b", write_adapter(tmp_path / "b", r=4))
    write_adapter(tmp_path / "b", 4, extra_tensors={key: torch.ones(16, 4)})      # rewritten after registration
    assert m.start_load(b)
    m.wait_loads()
    (failed, error), = m.poll()
    assert failed is b and "changed on disk" in error and pool.num_free == 16


def test_the_loader_needs_a_thread():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="loader_threads must be >= 1, got 0"):
        EngineConfig.create(loader_threads=0)


needs_c_packer = pytest.mark.skipif(__import__("kernels.cpu.lora_pack", fromlist=["_fn"])._fn() is None,
                                    reason="no C compiler here")


def cpu_manager(num_pages, **cfg):
    from kernels.cpu.lora_pack import GroupPacker
    pool = PagePool(num_pages)
    storage = torch.full((num_pages, PAGE), 7.0)        # stale bytes: a load must not depend on zeroed pages
    return AdapterManager(LoraConfig(**cfg), TINY, pool, storage, GroupPacker(torch.float32)), pool


@needs_c_packer
def test_a_load_packs_straight_into_its_pages_and_the_host_copy_follows(tmp_path):
    """The CPU packer writes the file into the pool's pages (no staging buffer); the host tier's copy is taken
    from those pages afterwards, and a reload from it gives the same pages."""
    from engine.lora.loader import read_packed
    m, pool = cpu_manager(32)
    a = m.register("a", write_adapter(tmp_path / "a", r=4, targets=("q_proj", "v_proj", "down_proj"),
                                      config_extra={"rank_pattern": {"down_proj": 3}},
                                      extra_tensors=_rank3_down(tmp_path)))
    assert {s.rank for s in a.layout.modules.values()} == {3, 4} and a.layout.gaps
    assert m.start_load(a)
    m.wait_loads()
    assert a.state == AdapterState.RESIDENT and a.adapter_id not in m.host
    want = m.storage[a.pages].clone()
    staged = read_packed(a.files, a.layout, PAGE, torch.float32, m.packer).flatten()   # zeroed, then packed
    got = want.flatten()
    from kernels.lora_layout import GROUP_MODULES, GROUP_OF
    for (layer, mod), s in a.layout.modules.items():   # every element the kernels read (bytes between blocks
        g, i = GROUP_OF[mod]                            # are never read: stale there is fine)
        blk = a.layout.blocks[(layer, g)]
        for off, n in ((blk.a_offset, blk.rank * len(GROUP_MODULES[g]) * s.n_in),
                       (blk.b_offsets[i], m.packer.b_elems(blk.rank, s.n_out))):
            assert torch.equal(got[off:off + n], staged[off:off + n]), (layer, mod)
    assert a.copy is not None
    a.copy.result()
    m.poll()
    assert a.copy is None and torch.equal(m.host[a.adapter_id], want)
    assert m.evict_idle(100) == len(want) and a.state == AdapterState.DISK
    m.storage.fill_(-1.0)
    load(m, a)                                             # from the host tier: a copy of its pages
    assert m.stats.host_hits == 1 and torch.equal(m.storage[a.pages], want)
    m.unregister("a")
    assert pool.num_free == 32 and not m.host


@needs_c_packer
def test_a_host_copy_gives_way_to_a_load(tmp_path):
    m, pool = cpu_manager(32)
    a = m.register("a", write_adapter(tmp_path / "a", r=3))
    b = m.register("b", write_adapter(tmp_path / "b", r=3, seed=1))
    m.loader.pause()                                       # jobs wait: a's copy is queued, then b's load
    assert m.start_load(a)
    m.loader.resume()
    m.wait_loads()
    m.loader.pause()
    m.poll()                                               # a resident, nothing loading: a's copy starts
    copy = a.copy
    assert copy is not None
    assert m.start_load(b)                                 # a load submitted behind it
    m.loader.resume()
    m.wait_loads()
    with pytest.raises(Exception, match="load is waiting"):
        copy.result()
    assert b.state == AdapterState.RESIDENT
    m.poll()                                               # the copy is taken again once nothing loads
    for x in (a, b):
        while x.adapter_id not in m.host:
            if x.copy is not None:
                x.copy.result()
            m.poll()
        assert torch.equal(m.host[x.adapter_id], m.storage[x.pages])


def _rank3_down(tmp_path):
    """down_proj at rank 3 (its rank_pattern), below the adapter's rank 4: ranks 3..4 of its block are zeros."""
    g = torch.Generator().manual_seed(5)
    return {f"base_model.model.model.layers.{i}.mlp.down_proj.lora_{x}.weight": t for i in range(2)
            for x, t in (("A", torch.randn(3, 64, generator=g)), ("B", torch.randn(32, 3, generator=g)))}


@needs_c_packer
def test_evicting_or_dropping_an_adapter_abandons_its_host_copy(tmp_path):
    """A host copy in flight never holds pages: eviction and unregistering go ahead at once, the copy stops
    and is discarded."""
    m, pool = cpu_manager(32)
    a = m.register("a", write_adapter(tmp_path / "a", r=3))
    b = m.register("b", write_adapter(tmp_path / "b", r=3, seed=1))
    for x in (a, b):
        m.loader.pause()                                   # the copy waits: still in flight below
        m.start_load(x)
        m.loader.resume()
        m.wait_loads()
        m.loader.pause()
        m.poll()
        copy = x.copy
        assert copy is not None and m.evictable(x)
        if x is a:
            assert m.evict_idle(100) >= 1 and a.state == AdapterState.DISK
        else:
            m.unregister("b")
            assert "b" not in m.by_name and b.adapter_id not in m.by_id
        assert x.copy is None
        m.loader.resume()
        with pytest.raises(Exception, match="abandoned"):
            copy.result()
        m.poll()
        assert x.adapter_id not in m.host
    assert pool.num_free == 32
