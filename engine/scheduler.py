"""Continuous batching by token counts under one token budget per step.

Each step gives every scheduled request a number of new tokens to compute: 1 for a decoding request, up
to the budget (capped by `long_prefill_token_threshold`) for a prompt, so long prompts are prefilled in
chunks and prefill and decode of different requests share a step. When the pool runs out of pages the
most recently arrived running request is preempted: its blocks are freed and it is recomputed later.
Waiting requests are offered a place in the order of `WaitingQueue` (fair across adapters by default).

A step that fails (an exception in the model runner) makes its requests suspects (`requeue_suspects`):
they are preempted, and each then runs alone, in steps of its own, until it samples a token. A suspect
whose lone step fails again is the culprit (EngineCore fails it); the others carry on with no token lost.
While a suspect waits, no new request is admitted, so the pool drains towards it.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.waiting_queue import WaitingQueue

PREFETCH_AHEAD = 8   # without a cap on distinct adapters: prefetch for twice this many requests in line


@dataclass
class SchedulerOutput:
    """What the model runner computes this step: `num_new_tokens[i]` tokens of `requests[i]`,
    starting at its `num_computed_tokens`. Requests are ordered decodes (1 token) first."""
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, admission=None):
        self.config = config
        self.kv = kv
        self.admission = admission      # AdapterAdmission, or None without LoRA
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        suspect = self._next_suspect()
        if suspect is not None and self._schedule_alone(suspect, out):
            return out
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted and suspect is None:
            self._schedule_waiting(out, budget)
        return out        # in any order: the model runner lays the rows out (ModelRunner.order)

    def _chunk(self, req: Request, budget: int) -> int:
        return min(req.num_tokens - req.num_computed_tokens, budget,
                   self.config.long_prefill_token_threshold)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            while not self.kv.can_allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            self.kv.allocate(req, n)
            self._scheduled(req, n, out)
            budget -= n
            i += 1
        return budget

    # -- suspects of a failed step ----------------------------------------------------------------------
    def requeue_suspects(self, reqs: list[Request]) -> None:
        """The requests of a step that failed: preempted (recomputed later) and marked suspect."""
        out = SchedulerOutput()
        for req in reqs:
            if req.status == RequestStatus.RUNNING:
                req.suspect = True
                self._preempt(req, out)

    def _next_suspect(self) -> Request | None:
        running = next((r for r in self.running if r.suspect), None)
        return running or next((r for r in self.waiting.preempted if r.suspect), None)

    def _schedule_alone(self, req: Request, out: SchedulerOutput) -> bool:
        """Schedule `req` as the step's only request (preempting other running requests if its KV needs
        their pages); False if it cannot run now (its adapter is loading, or the pool is still full)."""
        budget = self.config.max_num_batched_tokens
        if req.status == RequestStatus.RUNNING:
            n = self._chunk(req, budget)
            while not self.kv.can_allocate(req, n) and len(self.running) > 1:
                self._preempt(next(r for r in reversed(self.running) if r is not req), out)
            if not self.kv.can_allocate(req, n):
                return False
            self.kv.allocate(req, n)
            self._scheduled(req, n, out)
            return True
        if self.admission and not self.admission.can_admit(req, False):
            self.admission.hold(req, False, may_load=True)
            return False
        cached = self.kv.find_cached_prefix(req)
        n = min(req.num_tokens - len(cached) * self.kv.block_size, budget, self.config.long_prefill_token_threshold)
        if not self.kv.can_allocate(req, n, cached):
            return False
        self._admit(req, n, cached, out)
        self.waiting.remove(req)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self.admission:
            self.admission.stop_running(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        adm = self.admission
        oldest = self.waiting.oldest()
        freeze_new = bool(adm and oldest and oldest.blocked_by_cap > adm.cfg.starvation_steps)
        # NOTE: skipped requests (adapter loading, cap) stay queued; the scan is bounded so a long queue
        # costs O(window) per step.
        window = 4 * self.config.max_num_seqs
        offers = self.waiting.order(Counter(r.adapter_id for r in self.running))
        admitted, stop = [], None
        places, awaiting_loads = self.config.max_num_seqs - len(self.running), 0
        if adm:
            adm.begin_pass()
        for i, req in enumerate(itertools.islice(offers, window)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                stop = req
                break
            frozen = freeze_new and req is not oldest
            if adm:
                adm.note_place(req, i)
            if adm and not adm.can_admit(req, frozen):
                if adm.hold(req, frozen, may_load=len(admitted) + awaiting_loads < places):
                    awaiting_loads += 1      # its place is taken by the load (in flight or not yet started)
                continue
            cached = self.kv.find_cached_prefix(req)
            remaining = req.num_tokens - len(cached) * self.kv.block_size
            n = min(remaining, budget, self.config.long_prefill_token_threshold)
            if not self.kv.can_allocate(req, n, cached):
                stop = req
                break
            admitted.append(req)
            self._admit(req, n, cached, out)
            budget -= n
        if adm:
            ahead = 2 * (adm.max_distinct or PREFETCH_AHEAD)
            self._prefetch(itertools.chain([stop] if stop else [], itertools.islice(offers, ahead)))
        for req in admitted:
            self.waiting.remove(req)

    def _admit(self, req: Request, n: int, cached, out: SchedulerOutput) -> None:
        """A waiting request starts running with `n` new tokens after its `cached` prefix blocks."""
        self.kv.allocate(req, n, cached)
        if self.admission:
            self.admission.admit(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._scheduled(req, n, out)

    def _scheduled(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """`req` computes its next `n` tokens this step; the policy is charged for the prompt tokens among
        them, every chunk (generated tokens are charged as they are sampled, `update`)."""
        prompt = max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
        if prompt:
            self.waiting.policy.on_prompt_scheduled(req, prompt)
        out.requests.append(req)
        out.num_new_tokens.append(n)

    def prefetch_waiting(self) -> None:
        """Before a step is scheduled: start the loads of the requests that could join it (as many as there
        are free places), so that requests which arrived since the last step get theirs under way now. The
        pages their KV will need stay free besides the running requests' (a load must not take them)."""
        places = self.config.max_num_seqs - len(self.running)
        if not (self.admission and self.waiting) or places <= 0:
            return
        bs = self.kv.block_size
        upcoming = list(itertools.islice(self.waiting.order(Counter(r.adapter_id for r in self.running)), places))
        reserve = self._kv_growth() + sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) for r in upcoming)
        for req in upcoming:
            if not self.admission.prefetch(req, reserve):
                break

    def _prefetch(self, upcoming) -> None:
        """Start loading the adapters of the next requests in line, beside the running ones' KV."""
        reserve = self._kv_growth()
        for req in upcoming:
            if not self.admission.prefetch(req, reserve):
                break

    def _kv_growth(self) -> int:
        """Pages the running requests may still need for their KV (each to its max_tokens)."""
        bs = self.kv.block_size
        final_blocks = (-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) for r in self.running)
        return sum(max(0, n - len(r.block_ids)) for n, r in zip(final_blocks, self.running))

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        """Advance every scheduled request; append sampled tokens (keyed by position in `out.requests`);
        return the requests that finished this step (their blocks already freed)."""
        finished = []
        for i, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
            token = sampled.get(i)
            if token is None:
                continue
            self.waiting.policy.on_generated(req, 1)
            req.suspect = False                   # it ran alone to a token: not the culprit
            reason = req.append_token(token)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Stop a request wherever it is (running or waiting) and free its blocks."""
        if req.status == RequestStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
            if self.admission:
                self.admission.stop_running(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.admission:
            self.admission.finished(req)
        self.waiting.policy.on_leave(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
