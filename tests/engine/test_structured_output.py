"""Structured outputs (engine/structured_output.py) on the default model: the output is in the constraint's
language (a JSON schema, any JSON object, a regex, choices, an EBNF grammar), greedy or sampled; rows without
one in the same batch are untouched; logprobs stay the raw model's; a request resent after a restart goes on
where it was; a constraint that cannot be compiled is a clear error and nothing is added."""
from __future__ import annotations

import json
import re

import msgspec
import pytest

from engine.llm import LLM
from engine.tokenizer import encode_chat
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams, StructuredOutputsParams
from tests.conftest import assert_pool_idle

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a fictional person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def constrained(temperature=0.0, seed=None, max_tokens=48, **spec) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_a_json_schema_is_followed_greedy_and_sampled(llm):
    outs = llm.chat([ASK] * 4, [constrained(json=PERSON)] + [constrained(1.0, s, json=PERSON) for s in (1, 2, 3)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        person = json.loads(c.text)
        assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 20
        assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert_pool_idle(llm)


def test_json_object_regex_choice_and_grammar(llm):
    obj = llm.chat(ASK, constrained(json_object=True, max_tokens=64))[0].outputs[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj.text
    outs = llm.generate(["Call me at", "Is the sky blue? Answer:", "The answer is"],
                        [constrained(regex=r"\(\d{3}\) \d{3}-\d{4}"),
                         constrained(1.0, 7, choice=["yes", "no", "it depends"]),
                         constrained(grammar='root ::= "The answer is " ("A" | "B") "."')])
    phone, choice, grammar = [o.outputs[0] for o in outs]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    assert choice.text in ("yes", "no", "it depends") and choice.finish_reason == "stop"
    assert grammar.text in ("The answer is A.", "The answer is B.")


def test_the_constraint_says_where_the_output_ends_whatever_min_tokens_and_ignore_eos_say(llm):
    params = [SamplingParams(temperature=0, max_tokens=16, min_tokens=10, ignore_eos=ignore,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])) for ignore in (0, 1)]
    for out in llm.generate(["Is water wet? Answer:"] * 2, params):
        c = out.outputs[0]
        assert c.text in ("yes", "no") and c.finish_reason == "stop", c
        assert c.token_ids[-1] in llm.engine.cfg.model.eos_token_ids, c.token_ids      # not a token all masked


def test_rows_without_a_constraint_are_untouched_and_logprobs_are_the_raw_models(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    alone = llm.generate("Once upon a time", plain)[0].outputs[0]
    forced = SamplingParams(temperature=0, max_tokens=12, logprobs=3,
                            structured_outputs=StructuredOutputsParams(choice=["zebra crossing"]))
    mixed, zebra = llm.generate(["Once upon a time", "Once upon a time"], [plain, forced])
    assert mixed.outputs[0].token_ids == alone.token_ids
    assert zebra.outputs[0].text == "zebra crossing"
    first = zebra.outputs[0].logprobs[0]       # the raw model's: its top 3, and the forced token's own logprob
    assert alone.logprobs[0].items() <= first.items() and first[zebra.outputs[0].token_ids[0]] < -5


def test_a_resent_request_goes_on_where_its_constraint_was(llm):
    """As after an engine restart: the prompt plus the k tokens received, resumed=k; the matcher follows them
    first, so the rest completes the same JSON."""
    ids = encode_chat(llm.tokenizer, ASK)
    params = constrained(json=PERSON)
    whole = llm.generate([ids], params)[0].outputs[0].token_ids
    core, k = llm.engine, 5
    rest = msgspec.structs.replace(params, max_tokens=params.max_tokens - k)
    core.add_request(GenerateRequest("resent", ids + whole[:k], rest, resumed=k))
    got = []
    while core.has_unfinished():
        for o in core.step():
            got += o.new_token_ids
    assert whole[:k] + got == whole


@pytest.mark.parametrize("spec, says", [
    (dict(regex="("), "structured_outputs.regex: "),
    (dict(json='{"type": "object"'), "structured_outputs.json: "),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar: "),
    (dict(regex="a", choice=["b"]), "exactly one of"),
    (dict(choice=[]), "non-empty list"),
])
def test_a_constraint_that_cannot_be_used_is_a_clear_error_and_nothing_is_added(llm, spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))
        llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=4), bad])
    assert not llm.engine.has_unfinished()
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
