"""The synchronous engine core: requests in, one model step at a time, token outputs out.

Used directly by the offline `LLM` and, inside the engine process, by the step actor. Not thread-safe:
one caller at a time.
"""
from __future__ import annotations

import logging
import time

import torch

from engine import envs
from engine.config import EngineConfig
from engine.core.outputs import TokenOutput
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner, page_elems
from engine.page_pool import PagePool
from engine.request import FinishReason, Request
from engine.scheduler import Scheduler
from ipc.requests import GenerateRequest

log = logging.getLogger("loraplex.engine")


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        torch.set_num_threads(envs.num_threads())
        self.cfg = cfg
        page_bytes = page_elems(cfg) * cfg.model.dtype.itemsize
        num_pages = cfg.cache.kv_cache_memory_bytes // page_bytes
        if num_pages < 2:
            raise ValueError(f"kv_cache_memory_bytes={cfg.cache.kv_cache_memory_bytes} holds fewer than 2 "
                             f"pages of {page_bytes} bytes")
        self.pool = PagePool(num_pages)
        self.kv = KVCacheManager(self.pool, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.kv)
        self.runner = ModelRunner(cfg, num_pages)
        self.requests: dict[str, Request] = {}
        log.info("engine ready: model %s (%s), %d pages of %d KiB", cfg.model.name, cfg.model.dtype,
                 num_pages, page_bytes // 1024)

    # -- requests ---------------------------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, max_tokens: int | None) -> int:
        room = self.cfg.model.max_model_len - prompt_len
        return room if max_tokens is None else min(max_tokens, room)

    def validate(self, req: GenerateRequest) -> None:
        """Raise ValueError naming what is wrong; nothing is added."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must contain at least one token")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        limit = self.cfg.model.max_model_len
        if n >= limit:
            raise ValueError(f"prompt: {n} tokens is too long; this model's context is {limit} tokens "
                             f"(at most {limit - 1} prompt tokens)")
        vocab = self.cfg.model.vocab_size
        if any(t < 0 or t >= vocab for t in req.prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        need = self.kv.blocks_needed(n + self.max_tokens_for(n, req.params.max_tokens))
        if need > self.pool.num_pages:
            raise ValueError(f"prompt + max_tokens need {need} KV blocks; the pool holds {self.pool.num_pages}")

    def add_request(self, req: GenerateRequest, adapter_id: int = 0) -> None:
        self.validate(req)
        r = Request(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), params=req.params,
                    max_tokens=self.max_tokens_for(len(req.prompt_token_ids), req.params.max_tokens),
                    eos_token_ids=self.cfg.model.eos_token_ids, adapter_id=adapter_id,
                    cache_salt=req.cache_salt, arrival=time.monotonic())
        self.requests[r.request_id] = r
        self.scheduler.add(r)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, reason)
        self.runner.sampler.forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- stepping ---------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule, run the model once, and report every request that got a token or finished."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampled = self.runner.execute(out)
        finished = {id(r) for r in self.scheduler.update(out, sampled)}
        results = []
        for row, token in sampled.items():
            req = out.requests[row]
            done = id(req) in finished
            results.append(TokenOutput(req.request_id, [token], req.finish_reason.value if done else None,
                                       req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens))
            if done:
                self.requests.pop(req.request_id, None)
                self.runner.sampler.forget(req.request_id)
        return results
