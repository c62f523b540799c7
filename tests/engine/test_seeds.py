"""A seeded request's output is a function of its seed and prompt alone: the same after a step that failed
and ran again, and when the request is resent with its earlier output after an engine restart (each
token's draw is a function of the seed and the token's index: engine/sampler.py)."""
from __future__ import annotations

import msgspec
import pytest

import engine.sampler as sampler
from engine.llm import LLM
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle

PROMPTS = ["Once upon a time", "The capital of France is", "Name three colors:"]
SEEDED = [SamplingParams(temperature=1.0, top_p=0.95, seed=11 + i, max_tokens=16, ignore_eos=True) for i in range(3)]


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def run_to_end(llm, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    core, tokens = llm.engine, {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    return tokens


def test_a_resent_request_carries_on_with_the_tokens_it_would_have_drawn(llm):
    """As the client library resends after an engine restart: the prompt plus the k tokens received,
    `resumed=k`, max_tokens less k."""
    ids = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    whole = run_to_end(llm, [GenerateRequest(f"w{i}", ids[i], SEEDED[i]) for i in range(3)])
    for k in (1, 7):
        resent = [GenerateRequest(f"r{k}-{i}", ids[i] + whole[f"w{i}"][:k],
                                  msgspec.structs.replace(SEEDED[i], max_tokens=16 - k), resumed=k) for i in range(3)]
        rest = run_to_end(llm, resent)
        for i in range(3):
            assert whole[f"w{i}"][:k] + rest[f"r{k}-{i}"] == whole[f"w{i}"], (k, PROMPTS[i])
    assert len({tuple(t) for t in whole.values()}) == 3
    assert_pool_idle(llm)


def test_a_step_that_fails_after_drawing_changes_no_seeded_token(llm, monkeypatch):
    clean = llm.generate(PROMPTS, SEEDED)
    invert, calls = sampler._invert_cdf, []

    def failing_once(probs, u):          # the 4th sampling step fails after its numbers were drawn
        calls.append(len(probs))
        if len(calls) == 4:
            raise RuntimeError("lost the device mid-sampling")
        return invert(probs, u)
    monkeypatch.setattr(sampler, "_invert_cdf", failing_once)
    failed = llm.engine.num_failed_steps
    outs = llm.generate(PROMPTS, SEEDED)
    assert llm.engine.num_failed_steps == failed + 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in clean]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
