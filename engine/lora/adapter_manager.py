"""The adapter registry and its memory tiers: disk -> host cache -> pages of the unified pool.

The host tier (engine/lora/host_tier.py) holds adapters already packed as their pages, so a load from it
is one copy. Every load runs in the loader (engine/lora/loader.py), off the step thread.

Invariants:
- registering reads only the adapter's config and safetensors header (engine/lora/host_adapter.py:
  describe_adapter), never its weights: an adapter's bytes are first read when something needs them;
- an adapter is RESIDENT when its packed weights fill `pages` (allocated from the shared PagePool);
- a LOADING adapter owns its pages, but only the loader writes them; it is neither evicted nor used by a
  step until `poll` (on the engine thread, between steps) has seen its job finish;
- a resident adapter with `active > 0` (running requests) or `pinned` is never evicted; the others are
  evicted least recently used first, when KV blocks or another adapter need the pages;
- on the host a load from the file packs straight into the pages (no staging copy): the host tier's copy
  of that adapter is taken afterwards, from its pages (`_host_copies`: only while no load is in flight, one
  at a time, between forward passes); evicting or dropping the adapter meanwhile abandons that copy
  (`_abandon_copy`), never waits for it.
"""
from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import LoraConfig, ModelConfig
from engine.lora import compose, dora
from engine.lora.compose import ComposedFiles, check_members, display_name
from engine.lora.digest import content_digest, known_digest, shape_key
from engine.lora.host_adapter import AdapterFiles, describe_adapter
from engine.lora.host_tier import HostTier
from engine.lora.loader import AdapterLoader
from engine.lora.page_copier import PageCopier
from engine.page_pool import PageKind, PagePool
from ipc.adapter_names import check_adapter_name
from kernels.lora_layout import LoraPacker, PackedLayout

log = logging.getLogger("loraplex.lora")
SMALL_LOAD_BYTES = 8 << 20   # a load writing at most this much into the pool may hold a step back...
SMALL_LOAD_WAIT_S = 0.004    # ...for at most this long (finish_small_loads)
BUSY_REST_S = 0.05       # a background digest while the engine works: one 1 MiB chunk each (~1% of a core)


class _Closed(Exception):
    """The manager closed while a background digest read its file."""


class AdapterState(str, enum.Enum):
    DISK = "disk"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass(eq=False)
class Adapter:
    name: str
    adapter_id: int
    path: Path
    files: AdapterFiles
    layout: PackedLayout
    pinned: bool = False
    state: AdapterState = AdapterState.DISK
    pages: list[int] = field(default_factory=list)
    active: int = 0          # running requests using the pages
    queued: int = 0          # requests admitted to the engine and not finished
    unregistering: bool = False
    future: Future | None = None
    copy: Future | None = None   # its pages being copied into the host tier
    copy_stop: threading.Event | None = None   # set: that copy is abandoned (its pages freed)
    error: str | None = None
    load_started: float = 0.0   # time.monotonic() when its current load began
    digest: str = ""            # its content (engine/lora/digest.py), "" until hashed: names of one content
    names: set[str] = field(default_factory=set)   # share this Adapter; the names registered for it
    shape_key: str = ""
    members: tuple[tuple[int, float], ...] = ()   # a composition (engine/lora/compose.py): its (id, weight)s


@dataclass
class AdapterStats:
    loads: int = 0
    evictions: int = 0
    cold_starts: int = 0     # requests that had to wait for their adapter's load
    hits: int = 0            # requests whose adapter was already resident
    host_hits: int = 0
    host_misses: int = 0
    failed_loads: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.cold_starts
        return self.hits / n if n else 1.0


class AdapterManager:
    def __init__(self, cfg: LoraConfig, model: ModelConfig, pool: PagePool, storage: torch.Tensor,
                 packer: LoraPacker | None = None, base_weight: dora.BaseWeight | None = None):
        """packer: the compute backend's layout of adapters in pages (Backend.lora_packer); base_weight:
        (layer, projection) -> the base model's W [out, in] (ModelRunner.base_weight), which DoRA adapters'
        loads read (engine/lora/dora.py); None: DoRA adapters are refused."""
        self.base_weight = base_weight
        self.cfg = cfg
        self.model = model
        self.pool = pool
        self.storage = storage              # [num_pages, page_elems], shared with the KV cache
        self.page_elems = storage.shape[1]
        self.packer = packer or LoraPacker()
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}
        self.by_key: dict[str, list[Adapter]] = {}  # shape key (engine/lora/digest.py) -> registered adapters
        self.digester = ThreadPoolExecutor(1, thread_name_prefix="loraplex-digest")
        # members -> their composition, least recently asked first (at most compose.MAX_KEPT)
        self.composed: OrderedDict[tuple[tuple[int, float], ...], Adapter] = OrderedDict()
        self._digested: deque[Adapter] = deque()   # digested in the background: twins to merge (engine thread)
        self.idle = threading.Event()               # set: the engine has nothing to run (EngineCore)
        self.idle.set()
        self._closed = False
        self.lru: OrderedDict[int, None] = OrderedDict()   # resident adapters, least recent first
        # the LOADING adapters, in the order their loads began: what each step's poll walks (never every
        # registered adapter: a server may know thousands)
        self.in_flight: dict[int, Adapter] = {}
        self._disk_bytes: int | None = None      # tier_bytes' disk figure; None: the registry changed since
        self.stats = AdapterStats()
        self.on_drop: list = []             # callbacks(adapter_id) when an adapter's weights are gone
        # adapter id -> place in line of its first waiting request, as far as the scheduler's current pass
        # has offered them (the others are further back): which queued adapters to evict first
        self.next_use: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.copier = PageCopier(storage)
        base = None if base_weight is None else dora.BaseRows(base_weight)
        scales = None if base is None else (lambda files, pace: dora.scales(files, model, base, pace))
        self.loader = AdapterLoader(storage, model.dtype, self.packer, self.copier.cuda, cfg.loader_threads,
                                    host_int8=cfg.host_tier_dtype == "int8", dora_scales=scales)
        self.host = HostTier(cfg.max_cpu_loras, cfg.max_cpu_lora_bytes)
        self._failed: list[tuple[Adapter, str]] = []   # failures wait_loads saw, for the next poll
        # host copies (see the module's invariants): resident adapters loaded in place that have none yet,
        # and the adapter whose copy is in flight (at most one)
        self._wanting: set[int] = set()
        self._copying: Adapter | None = None
        # each finished load's time and each cold-started request's wait for it, for metrics to take and clear
        # (bounded: an offline LLM has no one taking them)
        self.load_seconds: deque[float] = deque(maxlen=4096)
        self.load_waits: deque[float] = deque(maxlen=4096)
        self.recent_loads: deque[tuple[str, float, float]] = deque(maxlen=64)   # (name, seconds, time.time())

    # -- registry ---------------------------------------------------------------------------------------
    def describe(self, path: str | Path) -> AdapterFiles:
        """Validate an adapter's config and weight shapes (no weights read; any thread may call it)."""
        files = describe_adapter(path, self.model, self.cfg.max_lora_rank)
        if files.magnitudes and self.base_weight is None:
            raise ValueError(f"adapter: {path} is a DoRA adapter; this engine has no base model weights to "
                             f"compute its magnitudes' scales from")
        return files

    def register(self, name: str, path: str | Path, pinned: bool = False, files: AdapterFiles | None = None,
                 hash_now: bool = True) -> Adapter:
        """Register the adapter at `path` under `name`, described by `files` (describe(path) if not given).

        Adapters are known by content (engine/lora/digest.py): a name whose content is already registered
        under another name becomes one more name of that adapter (one set of pages, one host copy, one
        prefix cache). Registering a name again with the same content changes nothing; with other content
        the old adapter is unregistered (its prefix-cache blocks dropped) once its requests finish and new
        requests get the new weights, never the old ones' pages or KV blocks. Only adapters with the same
        shape key are compared, and with `hash_now` hashed here if their digests are not known yet; without
        it (the server: hashing 78 MB on the serving path stalls the streams) only known digests are
        compared, and twins found later by the background digests are merged then (`_merge_digested`).
        A pinned adapter's load starts at once."""
        check_adapter_name(name)
        path = Path(path)
        files = files or self.describe(path)
        key = shape_key(files)
        old = self.by_name.get(name)
        twins = self._twins(key)
        digest = ""
        if twins:
            digest = content_digest(path) if hash_now else known_digest(path)
            if hash_now:
                for t in twins:
                    t.digest = t.digest or content_digest(t.path)
            same = next((t for t in twins if digest and t.digest == digest and (t.pinned or not pinned)), None)
            if same is not None and same is old:
                return old
            if same is not None:
                if old is not None:
                    self.unregister(name)
                self.by_name[name] = same
                same.names.add(name)
                self._disk_bytes = None
                return same
        layout = dora.plan(self.packer.plan(files.module_shapes(), self.page_elems), files, self.model,
                           self.page_elems)
        need = layout.num_pages(self.page_elems)
        if pinned and self._pinned_pages() + need + self._largest_pages(need) > self.pool.num_pages:
            raise ValueError(f"adapter {name!r}: pinning it would leave no room in the pool for another adapter")
        if need > self.pool.num_pages:
            raise ValueError(f"adapter {name!r} needs {need} pages; the pool holds {self.pool.num_pages}")
        old = self.by_name.get(name)
        if old is not None:
            self.unregister(name)
        a = Adapter(name, next(self._ids), path, files, layout, pinned, digest=digest, names={name}, shape_key=key)
        self.by_name[name] = a
        self._disk_bytes = None
        self.by_id[a.adapter_id] = a
        self.by_key.setdefault(key, []).append(a)
        if not a.digest:
            self.digester.submit(self._digest_later, a)
        if pinned:
            self.start_load(a)
        return a

    def unregister(self, name: str) -> None:
        """Refuse new requests for `name` now; once no name is left for its content, free its pages and host
        copy when its requests are done."""
        a = self.by_name.pop(name, None)
        if a is None:
            raise KeyError(f"adapter {name!r} is not registered")
        self._disk_bytes = None
        a.names.discard(name)
        if a.names:
            if a.name == name:
                a.name = min(a.names)
            return
        self._forget_key(a)
        a.unregistering = True
        self._drop_compositions(a)
        self._maybe_drop(a)

    def _forget_key(self, a: Adapter) -> None:
        same_key = self.by_key.get(a.shape_key, [])
        if a in same_key:
            same_key.remove(a)
            if not same_key:
                del self.by_key[a.shape_key]

    def _twins(self, key: str) -> list[Adapter]:
        """The registered adapters (loadable, not going away) with this shape key."""
        return [a for a in self.by_key.get(key, ()) if not a.unregistering and a.error is None]

    def _digest_later(self, a: Adapter) -> None:
        """On the digest thread: an adapter's digest (for /v1/models, and to find twins registered under
        other names), read at full speed only while the engine is idle and no load is pending, else one
        chunk per BUSY_REST_S. A failure leaves it unknown."""
        try:
            if not a.digest:
                a.digest = content_digest(a.path, pace=self._rest_unless_idle)
        except _Closed:
            return
        except (OSError, ValueError) as e:
            log.warning("adapter %r: no content digest: %s", a.name, e)
            return
        self._digested.append(a)

    def _rest_unless_idle(self) -> None:
        if self._closed:
            raise _Closed
        if not self.idle.is_set() or self.loader.loads_pending():
            time.sleep(BUSY_REST_S)

    def _merge_digested(self) -> None:
        """On the engine thread: adapters whose background digest equals a shape twin's become one adapter:
        the one in the pool (else the older) keeps every name, the other is unregistered (its requests
        finish on it; its pages, host copy and prefix-cache blocks are freed when they are done)."""
        while self._digested:
            a = self._digested.popleft()
            if a.unregistering or not a.names:
                continue
            for t in self._twins(a.shape_key):
                if t is a or t.digest != a.digest:
                    continue
                keep, lose = sorted((a, t), key=lambda x: (x.state not in (AdapterState.RESIDENT,
                                                                             AdapterState.LOADING), x.adapter_id))
                if lose.pinned and not keep.pinned:
                    continue                    # a pinned name stays on an adapter that is kept resident
                for n in lose.names:
                    self.by_name[n] = keep
                keep.names |= lose.names
                lose.names = set()
                self._disk_bytes = None
                self._forget_key(lose)
                lose.unregistering = True
                self._drop_compositions(lose)
                self._maybe_drop(lose)
                log.info("adapters %s: one content (%s), served by one copy", sorted(keep.names), keep.digest)
                break

    def compose(self, members: Sequence[tuple[str, float]]) -> Adapter:
        """The derived adapter computing these registered adapters, each times its weight (engine/lora/
        compose.py), made at the first request for it: not loaded yet, loaded as any adapter is."""
        check_members(members, self.cfg.max_adapters_per_request)
        parts = [(self.lookup(name), float(w)) for name, w in members]
        for (name, _), (a, _) in zip(members, parts):
            if a.files.magnitudes:
                raise ValueError(f"adapters: {name!r} is a DoRA adapter; DoRA adapters are served alone, not "
                                 f"composed (a sum of DoRA adapters has no one magnitude)")
        key = tuple((a.adapter_id, w) for a, w in parts)
        c = self.composed.get(key)
        if c is not None:
            self.composed.move_to_end(key)
            return c
        files = ComposedFiles([(a.files, w) for a, w in parts])
        if files.rank > self.cfg.max_lora_rank:
            raise ValueError(f"adapters: their ranks add up to {files.rank}, above max_lora_rank="
                             f"{self.cfg.max_lora_rank} (a composition's rank is the sum of its members')")
        layout = self.packer.plan(files.module_shapes(), self.page_elems)
        if layout.num_pages(self.page_elems) > self.pool.num_pages:
            raise ValueError(f"adapters: together they need {layout.num_pages(self.page_elems)} pages; the pool "
                             f"holds {self.pool.num_pages}")
        c = Adapter(display_name(members), next(self._ids), files.path, files, layout, members=key)
        self.by_id[c.adapter_id] = c
        self.composed[key] = c
        self._forget_compositions()
        return c

    def _forget_compositions(self) -> None:
        """Keep at most compose.MAX_KEPT compositions (clients choose scales freely, so each new one would
        otherwise stay): forget the least recently asked ones that no request uses, pages and all."""
        excess = len(self.composed) - compose.MAX_KEPT
        for key, c in list(self.composed.items()):
            if excess <= 0:
                break
            if not c.active and not c.queued:
                del self.composed[key]
                c.unregistering = True
                self._maybe_drop(c)
                excess -= 1

    def _drop_compositions(self, a: Adapter) -> None:
        """`a` goes away: so do the compositions it is a member of (their requests finish first)."""
        for key, c in list(self.composed.items()):
            if any(i == a.adapter_id for i, _ in key):
                del self.composed[key]
                c.unregistering = True
                self._maybe_drop(c)

    def placement(self, adapter_id: int) -> tuple[PackedLayout, list[int]]:
        """A resident adapter's layout and pages (what a step reads it from)."""
        a = self.by_id[adapter_id]
        return a.layout, a.pages

    def lookup(self, name: str) -> Adapter:
        a = self.by_name.get(name)
        if a is None:
            raise KeyError(f"adapter {name!r} is not registered")
        return a

    def names(self) -> list[str]:
        return sorted(self.by_name)

    # -- request references -----------------------------------------------------------------------------
    def enqueue(self, adapter_id: int) -> None:
        self.by_id[adapter_id].queued += 1

    def dequeue(self, adapter_id: int) -> None:
        a = self.by_id[adapter_id]
        a.queued -= 1
        self._maybe_drop(a)

    def acquire(self, adapter_id: int) -> None:
        """A request starts running with this (resident) adapter."""
        a = self.by_id[adapter_id]
        assert a.state == AdapterState.RESIDENT
        a.active += 1
        self.lru.move_to_end(adapter_id)

    def release(self, adapter_id: int) -> None:
        a = self.by_id[adapter_id]
        a.active -= 1
        self._maybe_drop(a)

    def is_resident(self, adapter_id: int) -> bool:
        return self.by_id[adapter_id].state == AdapterState.RESIDENT

    # -- loading ----------------------------------------------------------------------------------------
    def start_load(self, a: Adapter, evict_queued: bool = True, reserve: int = 0) -> bool:
        """Begin moving `a` into the pool (no-op if resident or loading). False if no room now.
        A prefetch passes evict_queued=False so it never evicts an adapter that queued requests need, and
        `reserve`: pages to leave free after it (the KV the running requests will still write; a prefetch
        into those pages would be evicted again for that KV before its request runs)."""
        if a.state != AdapterState.DISK:
            return True
        need = a.layout.num_pages(self.page_elems)
        if not self.pool.can_allocate(need + reserve):
            if reserve and self.pool.num_free + self._idle_pages(evict_queued) < need + reserve:
                return False          # do not evict adapters for a load that would not fit anyway
            self.evict_idle(need + reserve - self.pool.num_free, evict_queued)
            if not self.pool.can_allocate(need + reserve):
                return False
        a.pages = self.pool.allocate(need, PageKind.ADAPTER)
        a.state = AdapterState.LOADING
        self.in_flight[a.adapter_id] = a
        a.load_started = time.monotonic()
        packed = self.host.use(a.adapter_id)
        if packed is not None:
            self.stats.host_hits += 1
        else:
            self.stats.host_misses += 1
        a.future = self.loader.load(a.files, a.layout, a.pages, packed)
        return True

    def poll(self) -> list[tuple[Adapter, str]]:
        """Finish the loads whose job is done (on a GPU: enqueue their copy, then wait for its event in a
        later poll); return the adapters whose load failed, with the error. Costs microseconds."""
        failed, self._failed = self._failed, []
        if self._digested:
            self._merge_digested()
        for a in list(self.in_flight.values()):
            err = None
            if a.future is not None:
                if not a.future.done():
                    continue
                err = a.future.exception()
                if err is None:
                    packed, host = a.future.result()
                    if host is None:                # packed in place from its file: copied out later
                        self._wanting.add(a.adapter_id)
                    else:
                        self.host.put(a.adapter_id, host)
                    if self.copier.cuda:
                        self.copier.copy(a.adapter_id, a.pages, packed)
                a.future = None
            if err is None and not self.copier.done(a.adapter_id):
                continue                # NOTE: LOADING until the copy lands: its pages are not evictable
            del self.in_flight[a.adapter_id]
            if err is None:
                a.state = AdapterState.RESIDENT
                self.lru[a.adapter_id] = None
                self.stats.loads += 1
                self.load_seconds.append(time.monotonic() - a.load_started)
                self.recent_loads.append((a.name, self.load_seconds[-1], time.time()))
                self._maybe_drop(a)
            else:
                self.pool.free(a.pages)
                a.pages, a.state, a.error = [], AdapterState.DISK, str(err)
                self.stats.failed_loads += 1
                failed.append((a, str(err)))
                self._maybe_drop(a)
        if self._copying is not None or self._wanting:
            self._host_copies()
        return failed

    def settle(self) -> None:
        """Take every host copy that is due now, waiting for them: what the engine does when it has nothing to
        run (a copy runs only between forward passes and is taken by a poll, so an engine gone idle right
        after a load would otherwise leave it undone). Returns at once while a load is in flight. Twins found
        by the background digests are merged."""
        self._merge_digested()
        self._host_copies()
        while self._copying is not None:
            wait_futures([self._copying.copy])
            self._host_copies()

    def _host_copies(self) -> None:
        """Take a finished host copy into the host tier; start the next one only while no load is in flight
        (a load always goes first), one at a time, most recently used adapter first."""
        a = self._copying
        if a is not None:
            if a.copy is None:                      # abandoned (its adapter evicted or dropped)
                self._copying = None
            elif a.copy.done():
                if a.copy.exception() is None:
                    self.host.put(a.adapter_id, a.copy.result())
                else:                               # gave way to a load: taken again later
                    self._wanting.add(a.adapter_id)
                a.copy = a.copy_stop = self._copying = None
            else:
                return
        if not self._wanting or self.host.max_adapters <= 0 or self.loading():
            return
        adapter_id = next((i for i in reversed(self.lru) if i in self._wanting and not self.by_id[i].unregistering),
                          None)
        if adapter_id is None:
            return
        self._wanting.discard(adapter_id)
        a = self.by_id[adapter_id]
        if adapter_id not in self.host:
            a.copy_stop = threading.Event()
            a.copy = self.loader.copy_out(a.pages, a.copy_stop)
            self._copying = a

    def loading(self) -> bool:
        return bool(self.in_flight)

    def finish_small_loads(self) -> bool:
        """Before a step is scheduled while others run: give the loads in flight that write at most
        SMALL_LOAD_BYTES into the pool up to SMALL_LOAD_WAIT_S at full speed (both cores: no forward pass
        computes meanwhile), so that the requests waiting for them start in this step instead of the next
        (one step less to their first token), for a wait of about a millisecond to the running streams. A
        larger load stays paced beside the step (bench_load_stall). Not on a GPU: there loads are not paced
        and their pages' copy lands after a later poll, so a wait would only delay the step. -> whether any
        was waited for."""
        if self.copier.cuda or not self.loader.loads_pending():
            return False
        limit = SMALL_LOAD_BYTES // (self.page_elems * self.storage.element_size())
        small = [a.future for a in self.in_flight.values()
                 if a.future is not None and not a.future.done() and len(a.pages) <= limit]
        if not small:
            return False
        alone = self.loader.helper.alone
        alone.set()
        try:
            wait_futures(small, SMALL_LOAD_WAIT_S)
        finally:
            alone.clear()
        return True

    def wait_loads(self, timeout: float | None = None) -> None:
        """Block until every started load is finished, or (with `timeout`) until one job finishes or
        `timeout` seconds pass: what the engine does when nothing else can run."""
        futures = [a.future for a in self.in_flight.values() if a.future is not None]
        alone = self.loader.helper.alone
        alone.set()                        # nothing computes meanwhile: the jobs may take both cores
        try:
            if timeout is not None:
                if futures:
                    wait_futures(futures, timeout, return_when=FIRST_COMPLETED)
                return
            wait_futures(futures)
        finally:
            alone.clear()
        failed = self.poll()               # enqueue the copies; the failures go to the next poll's caller
        self._failed += failed
        for a in list(self.in_flight.values()):
            self.copier.wait(a.adapter_id)
        failed = self.poll()               # the copies have landed (on a GPU): mark their adapters resident
        self._failed += failed

    # -- eviction ---------------------------------------------------------------------------------------
    def _idle_pages(self, evict_queued: bool) -> int:
        """Pages evict_idle(..., evict_queued) could free."""
        idle = (self.by_id[i] for i in self.lru)
        return sum(len(a.pages) for a in idle if self.evictable(a) and (evict_queued or not a.queued))

    def evictable(self, a: Adapter) -> bool:
        return a.state == AdapterState.RESIDENT and a.active == 0 and not a.pinned

    def evict_idle(self, num_pages: int, evict_queued: bool = True, keep: int = 0) -> int:
        """Evict idle resident adapters (never `keep`) until `num_pages` pages are freed: those no queued
        request needs first, least recently used first; then (only if `evict_queued`) those queued requests
        need, the one needed furthest back in line first (`next_use`)."""
        freed = 0
        for pass_queued in (False, True) if evict_queued else (False,):
            order = list(self.lru)
            if pass_queued:      # the adapter whose request is furthest back in line first (stable: LRU on ties)
                far = len(order) + len(self.next_use)
                order.sort(key=lambda i: -self.next_use.get(i, far))
            for adapter_id in order:
                a = self.by_id[adapter_id]
                if freed >= num_pages:
                    return freed
                if self.evictable(a) and (a.queued > 0) == pass_queued and adapter_id != keep:
                    freed += len(a.pages)
                    self._evict(a)
        return freed

    def _abandon_copy(self, a: Adapter) -> None:
        """Its pages are about to be freed: a host copy of them in flight stops and is discarded."""
        if a.copy is not None:
            a.copy_stop.set()
            a.copy = a.copy_stop = None
        self._wanting.discard(a.adapter_id)

    def _evict(self, a: Adapter) -> None:
        self._abandon_copy(a)
        self.pool.free(a.pages)
        a.pages = []
        a.state = AdapterState.DISK
        self.lru.pop(a.adapter_id, None)
        self.stats.evictions += 1
        for cb in self.on_drop:
            cb(a.adapter_id, False)

    def _maybe_drop(self, a: Adapter) -> None:
        """Free every byte of an unregistered adapter once nothing uses it."""
        if not a.unregistering or a.active or a.queued or a.state == AdapterState.LOADING:
            return
        self._abandon_copy(a)
        if a.state == AdapterState.RESIDENT:
            self.pool.free(a.pages)
            a.pages = []
            a.state = AdapterState.DISK
            self.lru.pop(a.adapter_id, None)
        self.host.pop(a.adapter_id, None)
        self.by_id.pop(a.adapter_id, None)
        for cb in self.on_drop:
            cb(a.adapter_id, True)

    # -- reporting --------------------------------------------------------------------------------------
    def _pinned_pages(self) -> int:
        return sum(a.layout.num_pages(self.page_elems) for a in self.by_name.values() if a.pinned)

    def _largest_pages(self, default: int) -> int:
        return max([a.layout.num_pages(self.page_elems) for a in self.by_name.values()] + [default])

    def tier_bytes(self) -> dict[str, int]:
        """Adapter bytes per tier: pool (pages held, loading or resident), host (packed copies), disk (the
        registered adapters' weight files). Walks no registry (published every half second on the step
        thread): disk is recounted only after the registry changed."""
        page_bytes = self.page_elems * self.storage.element_size()
        if self._disk_bytes is None:
            self._disk_bytes = sum(a.files.nbytes for a in {id(a): a for a in self.by_name.values()}.values())
        return {"pool": self.pool.used[PageKind.ADAPTER] * page_bytes, "host": self.host.nbytes,
                "disk": self._disk_bytes}

    def tiers(self) -> dict[str, int]:
        """Adapters per tier (the resident ones are `lru`'s, the loading ones `in_flight`'s)."""
        return {"resident": len(self.lru), "loading": len(self.in_flight), "host": len(self.host),
                "registered": len(self.by_name)}

    def close(self) -> None:
        self._closed = True                 # a digest in progress stops at its next chunk (<= BUSY_REST_S away):
        self.digester.shutdown(wait=True, cancel_futures=True)      # waited for, so no thread outlives close()
        self.loader.close()

