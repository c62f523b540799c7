"""The unified page pool: fixed-size pages shared by KV blocks and adapter weights (S-LoRA).

Invariants:
- every page is in exactly one state: free (ref_count 0, in `free_queue`) or used (ref_count > 0);
- a free page may still hold a cached KV block (`page_hash` set): it is reused on a prefix hit and its
  hash is dropped when the page is handed out for something else (least recently freed first);
- `num_free + sum(used pages) == num_pages` at all times;
- `used[kind]` counts the used pages of each kind (kept as pages change hands, so `usage` costs O(1)).
"""
from __future__ import annotations

from collections import OrderedDict
from enum import Enum


class PageKind(str, Enum):
    FREE = "free"
    KV = "kv"
    ADAPTER = "adapter"


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        self.kind = [PageKind.FREE] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        # NOTE: OrderedDict as an O(1) LRU queue: oldest freed first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self.used = {PageKind.KV: 0, PageKind.ADAPTER: 0}
        self.prefix_hits = 0
        self.prefix_queries = 0

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def usage(self) -> dict[str, int]:
        """Pages by kind: kv, adapter, free (cached-but-free KV blocks count as free)."""
        return {PageKind.FREE.value: len(self.free_queue), **{k.value: n for k, n in self.used.items()}}

    # -- allocation -------------------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int, kind: PageKind) -> list[int]:
        """Take `n` free pages, least recently freed first, dropping any cached hash they held."""
        if n > len(self.free_queue):
            raise MemoryError(f"page pool: {n} pages requested, {len(self.free_queue)} free")
        pages = []
        for _ in range(n):
            page, _ = self.free_queue.popitem(last=False)
            self._drop_hash(page)
            self.ref_count[page] = 1
            self.kind[page] = kind
            pages.append(page)
        self.used[kind] += n
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages reaching zero go to the tail of the free queue.

        Pages are released in reverse order so that a sequence's last blocks are evicted first."""
        for page in reversed(pages):
            count = self.ref_count[page] - 1
            if count < 0:
                raise RuntimeError(f"page pool: page {page} freed more often than allocated")
            self.ref_count[page] = count
            if count == 0:
                self.used[self.kind[page]] -= 1
                self.kind[page] = PageKind.FREE
                self.free_queue[page] = None

    # -- prefix cache -----------------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_page.get(block_hash)

    def touch(self, page: int) -> None:
        """Take a reference to a cached KV page found by `lookup`."""
        if self.ref_count[page] == 0:
            del self.free_queue[page]
            self.kind[page] = PageKind.KV
            self.used[PageKind.KV] += 1
        self.ref_count[page] += 1

    def cache(self, page: int, block_hash: bytes) -> None:
        """Register a full KV block under its chained hash (first writer wins)."""
        if self.page_hash[page] is None and block_hash not in self.hash_to_page:
            self.page_hash[page] = block_hash
            self.hash_to_page[block_hash] = page

    def evict_cached(self, block_hashes) -> int:
        """Forget the given hashes (e.g. an adapter re-registered with new weights); return how many."""
        n = 0
        for h in block_hashes:
            page = self.hash_to_page.pop(h, None)
            if page is not None:
                self.page_hash[page] = None
                n += 1
        return n

    def _drop_hash(self, page: int) -> None:
        h = self.page_hash[page]
        if h is not None:
            self.page_hash[page] = None
            if self.hash_to_page.get(h) == page:
                del self.hash_to_page[h]
