"""The offline API in bfloat16 (the default): chat, sampling, stops, errors."""
import pytest

from engine.llm import LLM
from ipc.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert_pool_idle(llm)


def test_chat_takes_tools_and_a_template_of_its_own(llm):
    """LLM.chat(tools=, chat_template=), as vLLM's: the tools reach the template, which describes them."""
    from pathlib import Path

    from engine import StructuredOutputsParams
    template = (Path(__file__).parents[2] / "configs" / "tool_chat_template_hermes.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"enum": ["get_weather"]}, "arguments": tools[0]["function"][
            "parameters"]}, "required": ["name", "arguments"], "additionalProperties": False}))
    out = llm.chat(msgs, params, tools=tools, chat_template=template)[0]
    plain = llm.chat(msgs, params)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    assert "<tools>" in prompt and "get_weather" in prompt and "<tools>" not in llm.tokenizer.decode(
        plain.prompt_token_ids)
    assert '"name": "get_weather"' in out.text or '"name":"get_weather"' in out.text
    on = llm.chat([{"role": "user", "content": "What is the capital of France?"},
                   {"role": "assistant", "content": "The capital of France is"}],
                  SamplingParams(temperature=0, max_tokens=3), continue_final_message=True)[0]
    assert on.text.strip().startswith("Paris")


def test_same_seed_same_output_and_different_seed_differs(llm):
    p = [SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=s, max_tokens=24, ignore_eos=True)
         for s in (1, 1, 2)]
    a, b, c = llm.generate(["Write a poem about rivers."] * 3, p)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert len(a.token_ids) == 24 and a.finish_reason == "length"


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("Name three colors:", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    topk = llm.generate("Name three colors:", SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=10,
                                                             ignore_eos=True))[0]
    assert topk.token_ids == greedy.token_ids


def test_stop_string_and_stop_token(llm):
    base = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert " 5" in base.text
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[" 5"]))[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[: base.text.index(" 5")]
    tok = base.token_ids[2]
    stopped = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]))[0]
    assert stopped.token_ids == base.token_ids[:3] and stopped.finish_reason == "stop"
    assert_pool_idle(llm)


def test_token_id_prompt_equals_text_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    text = llm.generate("Hello there", params)[0]
    ids = llm.generate(llm.tokenizer("Hello there")["input_ids"], params)[0]
    assert text.token_ids == ids.token_ids


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_refused_and_engine_keeps_serving(llm):
    limit = llm.config.model.max_model_len
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([1] * limit, SamplingParams(max_tokens=1))
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2))[0].token_ids
    assert_pool_idle(llm)


def test_bad_dtype_and_a_model_of_no_served_family_are_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float8")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*does not serve.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_seed_out_of_range_is_refused():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2 ** 70)


def test_logit_bias_and_penalties_in_one_batch(llm):
    prompt = "List the numbers: 1, 1, 1, 1, 1, 1,"
    forced = llm.tokenizer(" Paris")["input_ids"][0]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0})
    penalized = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                               presence_penalty=1.0)
    outs = llm.generate([prompt] * 3, [plain, biased, penalized])
    assert outs[1].token_ids == [forced] * 6
    assert outs[0].token_ids == llm.generate(prompt, plain)[0].token_ids       # others unaffected
    most = lambda ids: max(ids.count(t) for t in set(ids))                   # noqa: E731
    assert most(outs[2].token_ids) < most(outs[0].token_ids)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={10 ** 7: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompt, SamplingParams(min_tokens=2, stop_token_ids=[10 ** 7]))


def test_min_tokens_holds_back_the_end(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40))[0]
    longer = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, min_tokens=len(short.token_ids) + 5))[0]
    assert short.finish_reason == "stop" and len(longer.token_ids) >= len(short.token_ids) + 5
    assert longer.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]   # the same up to the EOS
