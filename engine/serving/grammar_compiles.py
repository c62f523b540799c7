"""Structured-output constraints compiled beside the step loop (engine process). A request whose constraint
is not compiled yet waits here, not in the scheduler, while one thread compiles it (xgrammar releases the GIL:
the steps go on); then it goes back to the engine's inbox and is added as any other. A constraint that does
not compile is a 400 for its request alone; one that takes longer than COMPILE_TIMEOUT_S too (its compile
finishes in the background and is cached, so the thread is the only cost, once)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from engine.structured_output import Grammars
from ipc.requests import GenerateRequest

COMPILE_TIMEOUT_S = 10.0


class GrammarCompiles:
    """requeue(identity, request): hand a request back to the engine's inbox; refuse(identity, request_id,
    reason, status): answer it with an error."""

    def __init__(self, grammars: Grammars, requeue: Callable[[bytes, GenerateRequest], None],
                 refuse: Callable[[bytes, str, str, int], Awaitable[None]]):
        self.grammars, self.requeue, self.refuse = grammars, requeue, refuse
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar")
        self.waiting: dict[str, bytes] = {}       # request id -> its frontend, while its constraint compiles
        self.tasks: set[asyncio.Task] = set()
        self.jobs: dict[bytes, asyncio.Future] = {}   # constraint (as text) -> its compile in flight: the n
                                                      # choices of one call, or many calls, wait for one compile

    def holds(self, identity: bytes, req: GenerateRequest) -> bool:
        """Whether `req` must wait for its constraint to compile (the compile is then started); False when it
        has none or it is compiled already."""
        spec = req.params.structured_outputs
        if spec is None or self.grammars.is_compiled(spec):
            return False
        self.waiting[req.request_id] = identity
        task = asyncio.create_task(self._compile(identity, req))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    def abort(self, request_id: str, identity: bytes) -> bool:
        """Drop a request still waiting for its compile (its client went away); whether it was one."""
        if self.waiting.get(request_id) != identity:
            return False
        del self.waiting[request_id]
        return True

    def _job(self, spec) -> asyncio.Future:
        key = msgspec.json.encode(spec)
        job = self.jobs.get(key)
        if job is None:
            job = asyncio.get_running_loop().run_in_executor(self.thread, self.grammars.compiled, spec)
            self.jobs[key] = job
            job.add_done_callback(lambda f: (self.jobs.pop(key, None), f.cancelled() or f.exception()))
        return job

    async def _compile(self, identity: bytes, req: GenerateRequest) -> None:
        job = self._job(req.params.structured_outputs)
        try:
            await asyncio.wait_for(asyncio.shield(job), COMPILE_TIMEOUT_S)
        except ValueError as e:
            error = str(e)
        except asyncio.TimeoutError:
            error = (f"structured_outputs: the constraint did not compile within {COMPILE_TIMEOUT_S:.0f} s; "
                     f"make it smaller (bounded repetitions, fewer and shorter patterns)")
        else:
            error = None
        if self.waiting.pop(req.request_id, None) is None:
            return                                 # aborted meanwhile
        if error is not None:
            await self.refuse(identity, req.request_id, error, 400)
        else:
            self.requeue(identity, req)
