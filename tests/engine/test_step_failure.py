"""A model step that raises fails only the request that causes it: the others in the batch are recomputed
alone and carry on with every token they had (EngineCore._step_failed, Scheduler.requeue_suspects)."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle

PROMPTS = ["The capital of France is", "POISON Count: 1, 2, 3,", "Name three colors:", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def poison(llm, after_tokens: int):
    """Make the model step raise whenever the POISON request is in it with `after_tokens` outputs or more.
    -> the list of the steps' sizes (requests per step), from then on."""
    marker = llm.tokenizer("POISON")["input_ids"]
    execute, sizes = llm.engine.runner.execute, []

    def failing(out, lora=None):
        sizes.append(len(out.requests))
        for req in out.requests:
            if req.prompt_token_ids[:len(marker)] == marker and len(req.output_token_ids) >= after_tokens:
                raise RuntimeError("index 66506715 is out of bounds")
        return execute(out, lora)
    llm.engine.runner.execute = failing
    return sizes


def test_the_culprit_fails_and_the_rest_of_its_batch_loses_nothing(llm):
    clean = llm.generate(PROMPTS, GREEDY)
    failed_before = llm.engine.num_failed_steps
    sizes = poison(llm, after_tokens=3)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        del llm.engine.runner.execute
    bad = outs[1]
    assert bad.finish_reason == "abort" and "RuntimeError: index 66506715" in bad.error
    assert bad.token_ids == clean[1].token_ids[:3]          # what it had before the failing step
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].finish_reason == "length"
        assert outs[i].token_ids == clean[i].token_ids, PROMPTS[i]
    assert 1 in sizes and sizes.count(4) >= 3              # the suspects ran alone; the batch ran whole before
    assert llm.engine.num_failed_steps - failed_before == 2  # the batch's step, then the culprit's own
    assert_pool_idle(llm)


def test_a_step_failing_for_everyone_fails_each_request_alone_and_the_engine_goes_on(llm):
    clean = llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    failed_before = llm.engine.num_failed_steps

    def broken(out, lora=None):
        raise RuntimeError("device lost")
    llm.engine.runner.execute = broken
    try:
        outs = llm.generate(PROMPTS[:3], GREEDY)
    finally:
        del llm.engine.runner.execute
    assert all(o.finish_reason == "abort" and "device lost" in o.error for o in outs)
    assert llm.engine.num_failed_steps - failed_before == 4  # the batch's step, then each request alone
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == clean       # the engine serves on, as before
    assert_pool_idle(llm)


def test_a_request_whose_text_cannot_be_made_fails_alone(llm, monkeypatch):
    """The detokenizer raising for one request (after the model step) ends that request with the error; the
    others in the step keep their tokens and text, and its pages are freed (OutputProcessor.process)."""
    from engine.detokenizer import Detokenizer
    clean = llm.generate(PROMPTS, GREEDY)
    marker = llm.tokenizer("POISON")["input_ids"]
    init, update = Detokenizer.__init__, Detokenizer.update

    def tagged(self, tok, prompt_ids, *args):
        init(self, tok, prompt_ids, *args)
        self.poisoned = prompt_ids[:len(marker)] == marker

    def failing(self, new_ids, finished):
        if getattr(self, "poisoned", False) and len(self.ids) > 12:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return update(self, new_ids, finished)
    monkeypatch.setattr(Detokenizer, "__init__", tagged)
    monkeypatch.setattr(Detokenizer, "update", failing)
    outs = llm.generate(PROMPTS, GREEDY)
    bad = outs[1]
    assert bad.finish_reason == "abort" and "detokenizing" in bad.error and "UnicodeDecodeError" in bad.error
    assert 0 < len(bad.token_ids) < len(clean[1].token_ids)
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].finish_reason == "length"
        assert (outs[i].token_ids, outs[i].text) == (clean[i].token_ids, clean[i].text), PROMPTS[i]
    assert_pool_idle(llm)


def test_a_device_error_ends_the_engine_instead_of_failing_requests(llm):
    """A CUDA error leaves the device's state unknown: the step raises DeviceFault (the engine process exits
    with EXIT_DEVICE_FAULT and is started again; the frontends resend), no request is retried or failed here."""
    from engine.core.engine_core import DeviceFault, is_device_fault
    from ipc.requests import GenerateRequest

    def broken(out, lora=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    core = llm.engine
    failed_before = core.num_failed_steps
    core.add_request(GenerateRequest("dev-fault", llm.tokenizer(PROMPTS[0])["input_ids"], GREEDY))
    core.runner.execute = broken
    try:
        with pytest.raises(DeviceFault, match="illegal memory access"):
            core.step()
    finally:
        del core.runner.execute
    assert core.num_failed_steps == failed_before and not any(r.suspect for r in core.scheduler.running)
    core.abort("dev-fault")
    assert not is_device_fault(RuntimeError("index 66506715 is out of bounds"))
    assert not is_device_fault(ValueError("CUDA error"))             # a message alone, not a device error
    accelerator_error = getattr(__import__("torch"), "AcceleratorError", None)
    if accelerator_error is not None:
        assert is_device_fault(accelerator_error("anything"))
