"""Constraints compiled beside the step loop (engine/serving/grammar_compiles.py), with a stand-in compiler:
a request whose constraint is not compiled waits off the loop and comes back to the inbox once it is; one
that fails is a 400 for it alone; one aborted meanwhile is dropped; a compiled one is not held at all;
requests with one constraint share its compile. (The real compiler, and its time limit:
test_compile_worker.py.)"""
from __future__ import annotations

import asyncio
import threading

from engine.serving.grammar_compiles import GrammarCompiles
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams, StructuredOutputsParams


class SlowGrammars:
    """Compiles when `go` is set; regexes starting with "(" fail."""
    tokenizer_path, vocab_size, eos = "unused", 0, ()

    def __init__(self):
        self.go, self.done, self.calls = threading.Event(), set(), 0

    def is_compiled(self, spec) -> bool:
        return spec.regex in self.done

    def compiled(self, spec):
        self.calls += 1
        self.go.wait(30)
        if spec.regex.startswith("("):
            raise ValueError("structured_outputs.regex: the parenthesis is not closed")
        self.done.add(spec.regex)
        return spec.regex


def request(rid: str, regex: str | None) -> GenerateRequest:
    spec = None if regex is None else StructuredOutputsParams(regex=regex)
    return GenerateRequest(rid, [1, 2], SamplingParams(max_tokens=2, structured_outputs=spec))


def compiles():
    back, refused = [], []

    async def refuse(identity, rid, error, status):
        refused.append((identity, rid, error, status))
    grammars = SlowGrammars()
    return GrammarCompiles(grammars, lambda identity, req: back.append((identity, req.request_id)), refuse,
                           compile=grammars.compiled), back, refused


async def settle(c: GrammarCompiles) -> None:
    for _ in range(200):
        if not c.tasks:
            return
        await asyncio.sleep(0.01)


async def test_a_request_waits_for_its_compile_off_the_loop_and_comes_back():
    c, back, refused = compiles()
    assert not c.holds(b"f", request("plain", None))
    assert c.holds(b"f", request("r1", "[a-z]+"))
    for _ in range(20):                          # the loop goes on while the thread compiles
        await asyncio.sleep(0.005)
    assert back == [] and "r1" in c.waiting
    c.grammars.go.set()
    await settle(c)
    assert back == [(b"f", "r1")] and refused == [] and not c.waiting
    assert not c.holds(b"f", request("r2", "[a-z]+"))           # compiled now: added at once


async def test_a_constraint_that_fails_is_a_400_for_its_request_alone():
    c, back, refused = compiles()
    c.grammars.go.set()
    assert c.holds(b"f", request("bad", "(ab"))
    assert c.holds(b"f", request("good", "[a-z]+"))
    await settle(c)
    assert back == [(b"f", "good")]
    assert refused == [(b"f", "bad", "structured_outputs.regex: the parenthesis is not closed", 400)]


async def test_a_request_aborted_while_it_compiles_is_dropped():
    c, back, refused = compiles()
    assert c.holds(b"f", request("gone", "x+"))
    assert not c.abort("gone", b"another frontend")              # only its own frontend aborts it
    assert c.abort("gone", b"f")
    c.grammars.go.set()
    await settle(c)
    assert back == [] and refused == []


async def test_requests_with_one_constraint_wait_for_one_compile():
    """The n choices of one call (or many calls) with the same constraint: one compile, all of them back."""
    c, back, refused = compiles()
    assert all(c.holds(b"f", request(f"c{i}", "[0-9]+")) for i in range(4))
    c.grammars.go.set()
    await settle(c)
    assert c.grammars.calls == 1 and sorted(rid for _, rid in back) == ["c0", "c1", "c2", "c3"] and not c.jobs
