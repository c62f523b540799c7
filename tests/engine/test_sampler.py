"""The sampler: greedy rows, the sampled distribution, top-k / top-p support, seeds."""
from __future__ import annotations

import os

import pytest
import torch

from engine.sampler import History, Sampler, _invert_cdf, process_logits, seeded_uniform
from ipc.sampling_params import SamplingParams

DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))     # make gpu-check: cuda
LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0]) + 1e-30)


def draw(params, n=4000, seed=0):
    s = Sampler(seed)
    logits = LOGITS.repeat(n, 1)
    return torch.tensor(s.sample(logits, [params] * n, [0] * n))


def test_greedy_rows_take_argmax_next_to_sampled_rows():
    s = Sampler(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    out = s.sample(logits, params, [0] * 4)
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_frequencies_follow_the_softmax():
    counts = torch.bincount(draw(SamplingParams(temperature=1.0)), minlength=6).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0]), atol=0.03, rtol=0)


def test_temperature_sharpens():
    counts = torch.bincount(draw(SamplingParams(temperature=0.25)), minlength=6).float() / 4000
    expected = (LOGITS / 0.25).softmax(-1)
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


@pytest.mark.parametrize("params,support", [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.6), {0, 1}),
                                            (SamplingParams(top_p=0.4), {0}),
                                            (SamplingParams(top_k=3, top_p=0.99), {0, 1, 2})])
def test_top_k_and_top_p_limit_the_support(params, support):
    seen = set(draw(params, n=2000).tolist())
    assert seen == support


def test_top_k_renormalises_over_the_kept_tokens():
    counts = torch.bincount(draw(SamplingParams(top_k=2)), minlength=6).float() / 4000
    torch.testing.assert_close(counts[:2], torch.tensor([2 / 3, 1 / 3]), atol=0.03, rtol=0)


def test_seed_gives_the_same_tokens_whatever_shares_the_batch():
    logits = torch.randn(3, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    s = Sampler(0)
    crowd = s.sample(logits, [SamplingParams(temperature=1.0), p, SamplingParams(temperature=2.0)], [5, 3, 0])
    alone = Sampler(1).sample(logits[1:2], [p], [3])
    assert crowd[1] == alone[0]


def test_a_seeded_draw_is_a_function_of_the_seed_and_the_token_index_alone():
    """The k-th token of a seeded request draws the same number however many draws came before (a step run
    again after a failure, a request resent after an engine restart), and successive indices differ."""
    logits = torch.zeros(1, 1000)                      # uniform: the token is the draw itself, scaled
    p = SamplingParams(temperature=1.0, seed=2 ** 63 - 1)
    s = Sampler(0)
    first = [s.sample(logits, [p], [k])[0] for k in range(50)]
    again = [s.sample(logits, [p], [k])[0] for k in reversed(range(50))][::-1]
    assert first == again and len(set(first)) > 40
    assert [Sampler(9).sample(logits, [SamplingParams(temperature=1.0, seed=8)], [k])[0] for k in range(50)] != first
    u = [seeded_uniform(7, k) for k in range(10_000)]
    assert 0.0 <= min(u) and max(u) < 1.0 and abs(sum(u) / len(u) - 0.5) < 0.01


def test_invert_cdf_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]).repeat(50, 1)
    u = torch.cat([torch.zeros(50), torch.full((50,), 0.9999999)])
    u = torch.stack([u[:50], u[50:]], 1).flatten()
    out = _invert_cdf(probs, u).tolist()
    assert set(out[0::2]) == {1} and set(out[1::2]) == {3}


def test_logprobs_of_sampled_token_and_top_alternatives():
    from engine.sampler import logprobs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g).to(torch.bfloat16)
    params = [SamplingParams(temperature=0, logprobs=4), SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, logprobs=0)]
    out = logprobs(logits, [7, 3, 11], params)
    ref = logits.float().log_softmax(-1)
    assert out[1] is None
    assert out[0].token_id == 7 and abs(out[0].logprob - float(ref[0, 7])) < 1e-6
    assert out[0].top_ids == ref[0].topk(4).indices.tolist()
    assert out[0].top_logprobs == sorted(out[0].top_logprobs, reverse=True)
    assert out[2].top_ids == [] and abs(out[2].logprob - float(ref[2, 11])) < 1e-6   # before temperature
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


# -- logit processing: logit_bias and penalties -------------------------------------------------------

def test_logit_bias_steers_greedy_and_leaves_the_raw_logits_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    raw = logits.clone()
    target = int(logits[1].argmin())
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={target: 100.0}),
              SamplingParams(temperature=0, logit_bias={int(logits[2].argmax()): -100.0})]
    out = Sampler(0).sample(logits, params, [0] * 3, [History([], [])] * 3)
    assert out[0] == int(raw[0].argmax()) and out[1] == target
    assert out[2] == int(raw[2].topk(2).indices[1])          # the best token banned: the second best
    assert torch.equal(logits, raw)                            # logprobs are reported from the raw logits


def test_penalties_follow_their_definitions():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 40, generator=g) * 3
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 7, 9]
    p = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, [SamplingParams(temperature=0), p], [History([], []), History(prompt, output)])
    want = logits[1].clone()
    for t in set(prompt) | set(output):                        # HF / CTRL repetition penalty
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(output):                                      # OpenAI frequency and presence penalties
        want[t] -= 0.5 * output.count(t) + 0.25
    torch.testing.assert_close(got[1], want)
    torch.testing.assert_close(got[0], logits[0])              # rows without processing are unchanged


def test_a_frequency_penalty_stops_a_repetition_under_greedy():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    s = Sampler(0)
    p = SamplingParams(temperature=0, frequency_penalty=0.4)
    assert s.sample(logits, [p], [0], [History([0], [])]) == [1]
    assert s.sample(logits, [p], [0], [History([0], [1])]) == [1]       # 2.0 - 0.4 > 1.5
    assert s.sample(logits, [p], [0], [History([0], [1, 1])]) == [2]    # 2.0 - 0.8 < 1.5


@pytest.mark.parametrize("kw, name", [({"presence_penalty": 2.5}, "presence_penalty"),
                                      ({"frequency_penalty": -3}, "frequency_penalty"),
                                      ({"repetition_penalty": 0}, "repetition_penalty"),
                                      ({"logit_bias": {5: 101.0}}, "logit_bias"),
                                      ({"logit_bias": {-1: 1.0}}, "logit_bias"),
                                      ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
                                      ({"temperature": float("nan")}, "temperature")])
def test_bad_processing_settings_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])               # token 1 is EOS, 3 a stop id
    s = Sampler(0)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    stops = (3, 1)
    assert s.sample(logits, [p], [0], [History([0], [], stops)]) == [2]
    assert s.sample(logits, [p], [0], [History([0], [2], stops)]) == [2]
    assert s.sample(logits, [p], [0], [History([0], [2, 2], stops)]) == [1]    # reached: EOS again
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_a_resumed_request_counts_its_earlier_output_for_penalties_not_for_min_tokens():
    """Resent after an engine restart, a request's earlier output is at the end of its prompt; penalties
    still count it as output, while its (reduced) min_tokens counts what this request generated."""
    logits = torch.tensor([[0.0, 5.0, 3.0, 2.5]])                # EOS = 1
    p = SamplingParams(temperature=0, min_tokens=1, frequency_penalty=1.0)
    resumed = History([0], [2, 2], (1,), generated=0)             # two earlier tokens, none generated here
    assert process_logits(logits, [p], [resumed])[0, 2] == 1.0    # 3.0 - 2 x 1.0
    assert Sampler(0).sample(logits, [p], [0], [resumed]) == [3]   # EOS held back, 2 penalized


@pytest.mark.skipif(DEVICE.type == "cpu", reason="compares the test device with the host: make gpu-check "
                                                 "(LORAPLEX_TEST_DEVICE=cuda)")
def test_seeded_tokens_on_the_device_are_the_hosts():
    """The same logits and seeds give the same tokens on the device as on the host: the draws are made on
    the host (seeded_uniform) and the cut-offs (temperature, top-k, top-p) do not depend on the device."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 4096, generator=gen) * 3
    params = [SamplingParams(temperature=(0.5, 1.0, 1.3)[i % 3], top_p=(1.0, 0.9, 0.7)[i % 3],
                             top_k=(-1, 50, 400)[i % 3], seed=1000 + i) for i in range(64)]
    for k in (0, 1, 17):
        host = Sampler(0).sample(logits, params, [k] * 64)
        device = Sampler(0).sample(logits.to(DEVICE), params, [k] * 64)
        assert device == host, k
