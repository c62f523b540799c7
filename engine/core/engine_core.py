"""The synchronous engine core: requests in, one model step at a time, token outputs out.

Used directly by the offline `LLM` and, inside the engine process, by the step actor. Not thread-safe:
one caller at a time.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time

import torch

from engine import envs
from engine.config import EngineConfig
from engine.core.outputs import TokenOutput
from engine.kv_cache_manager import KVCacheManager
from engine.lora.adapter_manager import AdapterManager
from engine.lora.admission import AdapterAdmission
from engine.model_runner import ModelRunner, page_elems
from engine.page_pool import PagePool
from engine.request import FinishReason, Request
from engine.scheduler import Scheduler
from engine.structured_output import Grammars
from ipc.requests import GenerateRequest
from kernels.memory import keep_freed_memory

log = logging.getLogger("loraplex.engine")


class DeviceFault(RuntimeError):
    """The device failed in a step (a CUDA error): its memory and every later launch are suspect, so no
    request is retried here; the engine process exits and is started again (the frontends resend)."""


def is_device_fault(error: BaseException) -> bool:
    """A CUDA (or other accelerator) error, as opposed to a bug one request's input reaches."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in ("CUDA error", "CUBLAS_STATUS_", "cuDNN error",
                                                                       "device-side assert"))


def freeze_startup_objects() -> None:
    """For a process whose engine lives as long as the process (the server's engine process): the objects
    made so far (model, tokenizer, transformers' and torch's modules) never become garbage, so they are
    kept out of every later collection and a full collection no longer walks them (describing an adapter
    allocates thousands of small dicts and paid ~0.5 ms of collections for them). NOTE: not for an engine
    that is freed before its process ends (an offline LLM in a test): frozen cycles are never collected."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)    # at exit they are collected as before (extensions check for leaks)


class EngineCore:
    def __init__(self, cfg: EngineConfig):
        torch.set_num_threads(envs.num_threads())
        keep_freed_memory()
        self.cfg = cfg
        page_bytes = page_elems(cfg) * cfg.model.dtype.itemsize
        num_pages = cfg.cache.kv_cache_memory_bytes // page_bytes
        if num_pages < 2:
            raise ValueError(f"kv_cache_memory_bytes={cfg.cache.kv_cache_memory_bytes} holds fewer than 2 "
                             f"pages of {page_bytes} bytes")
        self.pool = PagePool(num_pages)
        self.kv = KVCacheManager(self.pool, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        self.runner = ModelRunner(cfg, num_pages)
        self.adapters = self.slots = admission = None
        if cfg.lora.enable_lora:
            self.adapters = AdapterManager(cfg.lora, cfg.model, self.pool, self.runner.storage,
                                           self.runner.backend.lora_packer(), self.runner.base_weight)
            self.slots = self.runner.backend.lora_slots(cfg.lora.max_loras, cfg.lora.max_lora_rank, cfg.model,
                                                        self.runner.storage)
            self.adapters.on_drop.append(self._adapter_dropped)
            self.runner.placement = self.adapters.placement
            self.kv.reclaim = self.adapters.evict_idle
            admission = AdapterAdmission(cfg.lora, self.adapters, self.slots)
        self.scheduler = Scheduler(cfg.scheduler, self.kv, admission)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(cfg.model.path, cfg.model.vocab_size, cfg.model.eos_token_ids)
        self.num_failed_steps = 0
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
        if not 0 <= req.resumed < n or req.resumed_chars < 0:
            raise ValueError(f"resumed: {req.resumed} tokens ({req.resumed_chars} characters) of a {n}-token prompt")
        if any(t >= vocab for t in req.params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if any(t >= vocab for t in req.params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if req.params.structured_outputs is not None:
            self.grammars.compiled(req.params.structured_outputs)      # ValueError naming what it cannot compile
        need = self.kv.blocks_needed(n + self.max_tokens_for(n, req.params.max_tokens))
        adapter_pages = 0
        if req.adapter is not None and self.adapters is not None and req.adapter in self.adapters.by_name:
            adapter_pages = self.adapters.by_name[req.adapter].layout.num_pages(self.adapters.page_elems)
        elif req.adapters and self.adapters is not None:
            adapter_pages = self.adapters.compose(req.adapters).layout.num_pages(self.adapters.page_elems)
        if need + adapter_pages > self.pool.num_pages:
            raise ValueError(f"prompt + max_tokens need {need} KV blocks" +
                             (f" and adapter {req.adapter!r} {adapter_pages} pages" if adapter_pages else "") +
                             f"; the pool holds {self.pool.num_pages} pages")

    # -- adapters ---------------------------------------------------------------------------------------
    def _lora_manager(self) -> AdapterManager:
        if self.adapters is None:
            raise ValueError("adapters: LoRA is disabled (enable_lora=False)")
        return self.adapters

    def register_adapter(self, name: str, path: str, pinned: bool = False, hash_now: bool = True) -> None:
        """hash_now: compare with same-shape adapters by hashing them now (AdapterManager.register)."""
        self._lora_manager().register(name, path, pinned, hash_now=hash_now)

    def prefetch_adapter(self, name: str) -> bool:
        """Start loading a registered adapter's weights now (the loader, beside the step) if the pool has
        room without evicting an adapter that queued requests need; False when it had none."""
        a = self._lora_manager().lookup(name)
        return self.adapters.start_load(a, evict_queued=False)

    def unregister_adapter(self, name: str) -> None:
        try:
            self._lora_manager().unregister(name)
        except KeyError as e:
            raise ValueError(str(e.args[0])) from None

    def _adapter_dropped(self, adapter_id: int, unregistered: bool) -> None:
        self.slots.drop(adapter_id)
        if unregistered:
            self.kv.drop_adapter_blocks(adapter_id)

    def adapter_id(self, name: str | None) -> int:
        """0 for the base model; ValueError naming the adapter when it is unknown."""
        if name is None:
            return 0
        if self.adapters is None or name not in self.adapters.by_name:
            raise LookupError(f"adapter {name!r} is not registered")
        return self.adapters.by_name[name].adapter_id

    # -- requests (continued) ---------------------------------------------------------------------------
    def request_adapter_id(self, req: GenerateRequest) -> int:
        """The adapter a request computes with: 0 (the base model), its adapter's, or its composition's
        (made at its first request); LookupError / ValueError naming what is wrong."""
        if req.adapters:
            if req.adapter is not None:
                raise ValueError("adapter and adapters: name the adapters of a composition in `adapters` alone")
            if self.adapters is None:
                raise LookupError("adapters: LoRA is disabled on this engine")
            return self.adapters.compose(req.adapters).adapter_id
        return self.adapter_id(req.adapter)

    def add_request(self, req: GenerateRequest) -> None:
        self.validate(req)
        spec = req.params.structured_outputs
        earlier = req.prompt_token_ids[len(req.prompt_token_ids) - req.resumed:]     # resent: its output so far
        grammar = None if spec is None else self.grammars.matcher(spec, earlier)
        adapter_id = self.request_adapter_id(req)
        r = Request(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), params=req.params,
                    max_tokens=self.max_tokens_for(len(req.prompt_token_ids), req.params.max_tokens),
                    eos_token_ids=self.cfg.model.eos_token_ids, adapter_id=adapter_id,
                    cache_salt=req.cache_salt, arrival=time.monotonic(), num_resumed=req.resumed,
                    tenant=req.tenant, grammar=grammar)
        if req.params.prompt_logprobs is not None:
            r.prompt_logprobs = [None] * len(r.prompt_token_ids)
        self.requests[r.request_id] = r
        if adapter_id:
            self.adapters.enqueue(adapter_id)
        self.scheduler.add(r)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req, reason)
        return True

    def report(self) -> dict:
        """Pool pages by kind, adapters per tier, adapter loads / evictions / cold starts / hit rate,
        prefix-cache hits, preemptions, running and waiting requests."""
        out = {"pages": self.pool.usage(), "num_pages": self.pool.num_pages,
               "prefix_cache": {"queries": self.pool.prefix_queries, "hits": self.pool.prefix_hits},
               "preemptions": self.scheduler.num_preemptions, "running": len(self.scheduler.running),
               "waiting": len(self.scheduler.waiting)}
        if self.adapters is not None:
            st = self.adapters.stats
            out["adapters"] = {**self.adapters.tiers(), "loads": st.loads, "evictions": st.evictions,
                               "cold_starts": st.cold_starts, "hits": st.hits, "hit_rate": st.hit_rate}
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- stepping ---------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule, run the model once, and report every request that got a token or finished."""
        if self.adapters is not None:
            self.adapters.idle.clear()          # background digests give way from now on
            if self.scheduler.running and self.scheduler.waiting:
                self.scheduler.prefetch_waiting()
                self.adapters.finish_small_loads()   # their requests can then start in this step
        results = self._finish_failed_loads()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.adapters is not None and self.adapters.loading():
                self.adapters.wait_loads(timeout=0.01)   # a job finishing, or new requests
            elif self.scheduler.waiting and not self.scheduler.running:
                results.append(self._fail_unservable(self.scheduler.waiting.oldest()))
            return results
        try:
            with self._loader_yields():
                result = self.runner.execute(out, self.slots)
        except Exception as e:  # noqa: BLE001 - one request's bad step must not fail the others in it
            if is_device_fault(e):
                raise DeviceFault(f"the device failed during a step: {type(e).__name__}: {e}") from e
            return results + self._step_failed(out, e)
        finished = {id(r) for r in self.scheduler.update(out, result.sampled)}
        for row, token in result.sampled.items():
            req = out.requests[row]
            done = id(req) in finished
            lp = result.logprobs.get(row)
            first = len(req.output_token_ids) == 1
            results.append(TokenOutput(req.request_id, [token], req.finish_reason.value if done else None,
                                       req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_tokens,
                                       [lp] if lp is not None else [], req.prompt_logprobs if first else None))
            if done:
                self.requests.pop(req.request_id, None)
        return results

    def _loader_yields(self):
        """Adapter loads pause while the forward pass computes (engine/lora/loader.py)."""
        return self.adapters.loader.step_running() if self.adapters is not None else contextlib.nullcontext()

    def settle(self) -> None:
        """Nothing to run: finish the background work that waits for such a moment (adapters' host copies,
        their digests, twins found by the digests)."""
        if self.adapters is not None:
            self.adapters.settle()
            self.adapters.idle.set()

    def _step_failed(self, out, error: Exception) -> list[TokenOutput]:
        """The model step over `out` raised. Run alone, a request is the culprit: it fails (status 500 at the
        server) and nothing else does. In a batch, every request in it becomes a suspect and is recomputed
        alone (Scheduler.requeue_suspects), so the culprit is found and no other request loses a token."""
        self.num_failed_steps += 1
        if len(out.requests) == 1 and out.requests[0].suspect:
            req = out.requests[0]
            log.error("request %s fails the model step on its own: failing it", req.request_id,
                      exc_info=(type(error), error, error.__traceback__))
            self.abort(req.request_id)
            return [TokenOutput(req.request_id, [], "abort", req.num_prompt_tokens, len(req.output_token_ids), 0,
                                error=f"internal error in the engine step: {type(error).__name__}: {error}")]
        log.warning("model step over %d requests failed (%s: %s); running each alone to find the cause",
                    len(out.requests), type(error).__name__, error)
        self.scheduler.requeue_suspects(out.requests)
        return []

    def _fail_unservable(self, req: Request) -> TokenOutput:
        """Nothing runs or loads, yet the head request cannot start: the pool cannot hold it (e.g. with
        pinned adapters). Fail it with an error instead of spinning."""
        self.abort(req.request_id)
        error = (f"request {req.request_id!r} does not fit in the pool next to the pinned adapters "
                 f"({self.pool.num_pages} pages)")
        return TokenOutput(req.request_id, [], "abort", req.num_prompt_tokens, 0, 0, error=error)

    def _finish_failed_loads(self) -> list[TokenOutput]:
        """An adapter whose load failed (bad weights, or its files changed on disk) fails its waiting requests,
        as a model that cannot be served (404), the status every later request for it gets too."""
        if self.adapters is None:
            return []
        results = []
        for adapter, error in self.adapters.poll():
            for req in [r for r in self.scheduler.waiting if r.adapter_id == adapter.adapter_id]:
                self.abort(req.request_id)
                results.append(TokenOutput(req.request_id, [], "abort", req.num_prompt_tokens, 0, 0,
                                           error=f"adapter {adapter.name!r} failed to load: {error}", status=404))
        return results
