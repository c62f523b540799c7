"""Structured-output constraints compiled beside the step loop (engine process). A request whose constraint
is not compiled yet waits here, not in the scheduler, while a thread of its own has the compile worker
(engine/serving/compile_worker.py, a child process) compile it; then the request goes back to the engine's
inbox and is added as any other. A constraint that does not compile is a 400 for its request alone; one
whose compile takes longer than COMPILE_TIMEOUT_S too, and its worker is killed, so it costs no more than
that (the next compile starts a fresh worker). Requests with the same constraint wait for one compile; the
others queue behind it, each compile timed from its own start."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from engine import metrics
from engine.serving.compile_worker import CompileTimeout, CompileWorker
from engine.serving.held_requests import HeldRequests
from engine.structured_output import Grammars
from ipc.requests import GenerateRequest
from ipc.sampling_params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0


class GrammarCompiles(HeldRequests):
    """requeue, refuse: as HeldRequests'. compile(spec): compile and keep `spec` in `grammars`, or raise
    ValueError (run on this object's thread; the worker's by default)."""

    def __init__(self, grammars: Grammars, requeue: Callable[[bytes, GenerateRequest], None],
                 refuse: Callable[[bytes, str, str, int], Awaitable[None]],
                 compile: Callable[[StructuredOutputsParams], None] | None = None):
        super().__init__(requeue, refuse)
        self.grammars = grammars
        self.worker = CompileWorker(grammars.tokenizer_path, grammars.vocab_size, grammars.eos)
        self.compile = compile or self._in_worker
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar")
        self.jobs: dict[bytes, asyncio.Future] = {}   # constraint (as text) -> its compile in flight
        self.warming: threading.Thread | None = None

    def holds(self, identity: bytes, req: GenerateRequest) -> bool:
        """Whether `req` must wait for its constraint to compile (the compile is then started, or joined);
        False when it has none or it is compiled already."""
        spec = req.params.structured_outputs
        if spec is None or self.grammars.is_compiled(spec):
            return False
        self.hold(identity, req, self._compile(spec), 400)
        return True

    def close(self) -> None:
        self.worker.close()

    def _in_worker(self, spec: StructuredOutputsParams) -> None:
        start, outcome = time.monotonic(), "error"
        try:
            text = self.worker.compile(spec, COMPILE_TIMEOUT_S)
            outcome = "ok"
        except CompileTimeout:
            outcome = "timeout"
            raise ValueError(f"structured_outputs: the constraint did not compile within {COMPILE_TIMEOUT_S:.0f} s; "
                             f"make it smaller (bounded repetitions, fewer and shorter patterns)") from None
        finally:
            metrics.GRAMMAR_COMPILES.labels(outcome).inc()
            metrics.GRAMMAR_COMPILE_SECONDS.observe(time.monotonic() - start)
        self.grammars.install(spec, text)

    def _job(self, spec: StructuredOutputsParams) -> asyncio.Future:
        key = msgspec.json.encode(spec)
        job = self.jobs.get(key)
        if self.warming is None and self.compile == self._in_worker:
            # the engine's own table of the tokenizer (which installing a compiled grammar needs: ~1.3 s with
            # xgrammar's import) is built while the worker starts (~3 s), not after it
            self.warming = threading.Thread(target=self.grammars.tokenizer_info, daemon=True,
                                            name="loraplex-grammar-table")
            self.warming.start()
        if job is None:
            job = asyncio.get_running_loop().run_in_executor(self.thread, self.compile, spec)
            self.jobs[key] = job
            job.add_done_callback(lambda f: self.jobs.pop(key, None))
        return job

    async def _compile(self, spec: StructuredOutputsParams) -> str | None:
        """None once `spec` is compiled, else why it is not."""
        try:
            await asyncio.shield(self._job(spec))
        except ValueError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - the pipe, say: the request is answered, the engine goes on
            return f"structured_outputs: the grammar compiler failed ({type(e).__name__}: {e})"
        return None
