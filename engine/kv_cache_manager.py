"""KV blocks of requests, taken from the unified page pool, with prefix caching.

A block is one page: `block_size` tokens of K and V for every layer. Full blocks are hashed as a chain:
hash(parent hash, block tokens, extra keys) where the extra keys are the request's adapter id and
cache salt, so two tenants or two adapters never share a block unless both match.
"""
from __future__ import annotations

import hashlib
import struct

from engine.page_pool import PageKind, PagePool
from engine.request import Request


def block_hash(parent: bytes | None, tokens: list[int], adapter_id: int, cache_salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    h.update(struct.pack("<q", adapter_id))
    if cache_salt is not None:
        h.update(b"salt:" + cache_salt.encode())
    return h.digest()


class KVCacheManager:
    def __init__(self, pool: PagePool, block_size: int, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # reclaim(n, keep) frees up to n pages held by idle adapters other than `keep` (S-LoRA: KV and
        # adapters share the pool; the adapter of the request being admitted must stay)
        self.reclaim = None
        self.adapter_hashes: dict[int, set[bytes]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request, upto_tokens: int) -> None:
        """Extend req.block_hashes to cover every full block among the first `upto_tokens` tokens."""
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= upto_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            tokens = [req.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            req.block_hashes.append(block_hash(parent, tokens, req.adapter_id, req.cache_salt))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Pages of the longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute, so that there are logits to sample from. A request
        that asks for prompt logprobs computes its whole prompt (its logits are needed at every position)."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        self.pool.prefix_queries += 1
        pages = []
        for h in req.block_hashes:
            page = self.pool.lookup(h)
            if page is None:
                break
            pages.append(page)
        if pages:
            self.pool.prefix_hits += 1
        return pages

    def can_allocate(self, req: Request, num_new_tokens: int, cached_pages: list[int] = ()) -> bool:
        have = len(req.block_ids) + len(cached_pages)
        need = self.blocks_needed(req.num_computed_tokens + len(cached_pages) * self.block_size
                                  + num_new_tokens) - have
        # NOTE: cached pages that sit in the free queue are counted free; touching them removes them.
        reclaimed = sum(1 for p in cached_pages if self.pool.ref_count[p] == 0)
        short = need - (self.pool.num_free - reclaimed)
        if short > 0 and self.reclaim is not None:
            self.reclaim(short, keep=req.adapter_id)
            short = need - (self.pool.num_free - reclaimed)
        return short <= 0

    def allocate(self, req: Request, num_new_tokens: int, cached_pages: list[int] = ()) -> None:
        """Give `req` the cached pages (advancing num_computed_tokens) and enough new blocks for
        `num_new_tokens` more tokens. Call only after `can_allocate` said yes."""
        for page in cached_pages:
            self.pool.touch(page)
        req.block_ids.extend(cached_pages)
        req.num_computed_tokens += len(cached_pages) * self.block_size
        req.num_cached_tokens = max(req.num_cached_tokens, len(cached_pages) * self.block_size)
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need, PageKind.KV))

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(req, req.num_computed_tokens)
        for i in range(req.num_cached_blocks, min(len(req.block_hashes), req.num_computed_tokens // self.block_size)):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
            if req.adapter_id:
                self._remember(req.adapter_id, req.block_hashes[i])
            req.num_cached_blocks = i + 1

    def _remember(self, adapter_id: int, h: bytes) -> None:
        hashes = self.adapter_hashes.setdefault(adapter_id, set())
        hashes.add(h)
        if len(hashes) > 2 * self.pool.num_pages:      # forget blocks the pool already reused
            hashes.intersection_update(self.pool.hash_to_page)

    def drop_adapter_blocks(self, adapter_id: int) -> int:
        """Forget every prefix-cache block computed with this adapter."""
        return self.pool.evict_cached(self.adapter_hashes.pop(adapter_id, ()))

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
