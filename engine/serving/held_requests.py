"""Requests held outside the scheduler, beside the step loop, until something the event loop gets for them
is ready: their constraint compiled (grammar_compiles.py), their adapters fetched (adapter_fetches.py).
Then each goes back to the engine's inbox and is added as any other, or is answered with the error."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine

from ipc.requests import GenerateRequest


class HeldRequests:
    """requeue(identity, request): hand a request back to the engine's inbox; refuse(identity, request_id,
    reason, status): answer it with an error."""

    def __init__(self, requeue: Callable[[bytes, GenerateRequest], None],
                 refuse: Callable[[bytes, str, str, int], Awaitable[None]]):
        self.requeue, self.refuse = requeue, refuse
        self.waiting: dict[str, bytes] = {}       # request id -> its frontend, while it is held
        self.tenants: dict[str, str] = {}         # request id -> its tenant ("": none), while it is held
        self.tasks: set[asyncio.Task] = set()

    def count(self, tenant: str | None = None) -> int:
        """Requests held now (of `tenant` only, if given): they count toward --max-waiting."""
        return len(self.waiting) if tenant is None else sum(1 for t in self.tenants.values() if t == tenant)

    def hold(self, identity: bytes, req: GenerateRequest, ready: Coroutine, status: int) -> None:
        """Hold `req` until `ready` returns: None to requeue it, or an error to answer it with `status`."""
        self.waiting[req.request_id] = identity
        self.tenants[req.request_id] = req.tenant
        task = asyncio.create_task(self._release(identity, req, ready, status))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def abort(self, request_id: str, identity: bytes) -> bool:
        """Drop a request still held (its client went away); whether it was one."""
        if self.waiting.get(request_id) != identity:
            return False
        del self.waiting[request_id]
        self.tenants.pop(request_id, None)
        return True

    async def _release(self, identity: bytes, req: GenerateRequest, ready: Coroutine, status: int) -> None:
        error = await ready
        self.tenants.pop(req.request_id, None)
        if self.waiting.pop(req.request_id, None) is None:
            return                                 # aborted meanwhile
        if error is not None:
            await self.refuse(identity, req.request_id, error, status)
        else:
            self.requeue(identity, req)
