"""Requests waiting for their adapters to arrive from the remote store (engine process), beside the step
loop, as requests wait for their constraints (grammar_compiles.py): a request naming an adapter the server
has nowhere (not registered, not in --adapter-dir, not in the store's cache, not refused lately) waits here,
not in the scheduler, while the event loop fetches it (engine/serving/adapter_source.py); then it goes back
to the engine's inbox and is added as any other, and its adapter is registered from the cache. A fetch that
fails answers its requests with a 404 giving the reason. Requests for one adapter share one fetch; every
other request keeps stepping."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from engine import metrics
from engine.serving.adapter_source import AdapterSource, FetchRefused
from engine.serving.held_requests import HeldRequests
from ipc.requests import AdapterCommand, GenerateRequest


class AdapterFetches(HeldRequests):
    """known(name): the server has the adapter without the store (registered or in --adapter-dir);
    requeue, refuse: as HeldRequests'."""

    def __init__(self, source: AdapterSource, known: Callable[[str], bool],
                 requeue: Callable[[bytes, GenerateRequest], None],
                 refuse: Callable[[bytes, str, str, int], Awaitable[None]]):
        super().__init__(requeue, refuse)
        self.source, self.known = source, known
        self.jobs: dict[str, asyncio.Task] = {}      # adapter name -> its fetch

    def missing(self, req: GenerateRequest) -> list[str]:
        names = [req.adapter] + [n for n, _ in req.adapters or ()]
        return [n for n in names if n and self.missing_name(n)]

    def missing_name(self, name: str) -> bool:
        """Whether only the store may have `name`, and it has not been asked lately."""
        return not self.known(name) and self.source.cached(name) is None and self.source.refusal(name) is None

    def holds(self, identity: bytes, req: GenerateRequest) -> bool:
        """Whether `req` must wait for adapters from the store (their fetches are then started, or joined)."""
        names = self.missing(req)
        if not names:
            return False
        self.hold(identity, req, self._arrived([self._job(n) for n in names]), 404)
        return True

    def holds_command(self, identity: bytes, cmd: AdapterCommand) -> bool:
        """Whether a load command (no path: the store's adapter) must wait for its fetch; it then goes back
        to the inbox however the fetch ends (a refusal is answered from the store's memory)."""
        if cmd.op != "load" or cmd.path or not self.missing_name(cmd.name):
            return False
        task = asyncio.create_task(self._command(identity, cmd))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _command(self, identity: bytes, cmd: AdapterCommand) -> None:
        try:
            await asyncio.shield(self._job(cmd.name))
        except FetchRefused:
            pass
        self.requeue(identity, cmd)

    def fetching(self) -> int:
        return len(self.jobs)

    def _job(self, name: str) -> asyncio.Task:
        job = self.jobs.get(name)
        if job is None:
            job = asyncio.create_task(self._fetch(name))
            self.jobs[name] = job
            job.add_done_callback(lambda _: self.jobs.pop(name, None))
        return job

    async def _fetch(self, name: str) -> None:
        start, outcome = time.monotonic(), "error"
        try:
            path = await self.source.fetch(name)
            outcome = "ok"
            metrics.ADAPTER_FETCH_BYTES.inc(sum(f.stat().st_size for f in path.iterdir()))
        finally:
            metrics.ADAPTER_FETCHES.labels(outcome).inc()
            metrics.ADAPTER_FETCH_SECONDS.observe(time.monotonic() - start)

    @staticmethod
    async def _arrived(jobs: list[asyncio.Task]) -> str | None:
        """None once every fetch succeeded, else the first one's reason."""
        error = None
        for job in jobs:
            try:
                await asyncio.shield(job)
            except FetchRefused as e:
                error = error or str(e)
        return error
