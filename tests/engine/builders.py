"""Builders for scheduler and pool tests that run without a model."""
from __future__ import annotations

import itertools

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.page_pool import PagePool
from engine.request import Request
from engine.scheduler import Scheduler
from ipc.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt_len: int = 10, max_tokens: int = 4, first_token: int = 0, **kw) -> Request:
    return Request(request_id=f"r{next(_ids)}", prompt_token_ids=list(range(first_token, first_token + prompt_len)),
                   params=SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens=max_tokens,
                   eos_token_ids=(), **kw)


def make_scheduler(num_pages: int = 64, block_size: int = 4, prefix: bool = True, **cfg) -> Scheduler:
    kv = KVCacheManager(PagePool(num_pages), block_size, prefix)
    return Scheduler(SchedulerConfig(**cfg), kv)


def fake_step(s: Scheduler, token: int = 7):
    """Schedule once and pretend the model sampled `token` for every request that finished its chunk."""
    out = s.schedule()
    sampled = {i: token for i, (r, n) in enumerate(zip(out.requests, out.num_new_tokens))
               if r.num_computed_tokens + n == r.num_tokens}
    return out, s.update(out, sampled)
