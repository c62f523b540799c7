"""Constraints compiled in a child process, so that one which would take minutes can be stopped.

xgrammar's compiler cannot be interrupted, and some small constraints take long (a JSON-schema string
`pattern` of `a{10000}` took 6 s on a Zen 4 core, `a{30000}` longer than 10). In a thread, such a compile
would hold that thread, and every constraint queued behind it, until it ends. Here the engine process
sends each constraint (its JSON) to `python -m engine.serving.compile_worker` over a pipe and reads back
the compiled grammar (xgrammar's JSON serialization, one line); a compile past its time limit kills the
worker, and the next compile starts a fresh one (~3 s: xgrammar's import and the tokenizer's table).
Nothing is pickled: lines of JSON both ways.

Protocol: the worker prints {"ready": true} once it can compile; then for each input line (a
StructuredOutputsParams as JSON) one output line, {"grammar": TEXT} or {"error": MESSAGE}.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

import msgspec

from ipc.sampling_params import StructuredOutputsParams

START_TIMEOUT_S = 120.0


class CompileTimeout(Exception):
    pass


class CompileWorker:
    """The engine side: one worker process at a time, started at the first compile. Not thread-safe: one
    thread calls compile() (GrammarCompiles' own)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos: tuple[int, ...]):
        self.args = [tokenizer_path, str(vocab_size), ",".join(map(str, eos))]
        self.proc: subprocess.Popen | None = None

    def compile(self, spec: StructuredOutputsParams, timeout: float) -> str:
        """`spec` compiled by the worker, as xgrammar's serialized CompiledGrammar; ValueError naming what is
        wrong with it; CompileTimeout after `timeout` seconds of compiling (the worker is then killed)."""
        proc = self._worker()
        proc.stdin.write(msgspec.json.encode(spec) + b"\n")
        proc.stdin.flush()
        try:
            reply = self._line(proc, timeout)
        except CompileTimeout:
            self.close()
            raise
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["grammar"]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _worker(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.serving.compile_worker", *self.args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
                                         preexec_fn=_killed_with_parent)
            try:
                self._line(self.proc, START_TIMEOUT_S)
            except (CompileTimeout, ValueError):
                self.close()
                raise ValueError("structured_outputs: the grammar compiler did not start") from None
        return self.proc

    @staticmethod
    def _line(proc: subprocess.Popen, timeout: float) -> dict:
        """The worker's next line, within `timeout` seconds (a line may come in many reads)."""
        deadline, chunks = time.monotonic() + timeout, []
        fd = proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CompileTimeout()
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise ValueError("structured_outputs: the grammar compiler exited")
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return json.loads(b"".join(chunks))


def _killed_with_parent() -> None:
    """In the child before exec: SIGKILL when the engine dies, even mid-compile (Linux's PR_SET_PDEATHSIG,
    armed from the thread that starts it, which lives as long as the engine's GrammarCompiles)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))     # 1: PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    """The worker: compile each constraint read from stdin (engine/structured_output.py's rules)."""
    from engine.structured_output import Grammars
    path, vocab, eos = argv
    grammars = Grammars(path, int(vocab), tuple(int(t) for t in eos.split(",") if t))
    grammars.tokenizer_info()
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            reply = {"grammar": grammars.compile_new(msgspec.json.decode(line, type=StructuredOutputsParams))
                     .serialize_json()}
        except ValueError as e:
            reply = {"error": str(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
