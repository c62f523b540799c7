"""RequestRoutes: a streamed request's deltas go out as they come, a non-streamed one's once, whole."""
from __future__ import annotations

from engine.serving.request_routes import RequestRoutes
from ipc.outputs import RequestOutput, TokenLogprobs


def lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(t, -0.5, [t], [-0.5])


def test_streamed_deltas_go_to_their_frontend_as_they_come_and_the_finished_request_is_forgotten():
    routes = RequestRoutes()
    routes.add("a", b"front-1", stream=True)
    first = RequestOutput("a", [1], "x")
    assert routes.route(first) == (b"front-1", first)
    last = RequestOutput("a", [2], "y", "stop")
    assert routes.route(last) == (b"front-1", last)
    assert routes.route(RequestOutput("a", [3], "z")) is None and routes.owned_by(b"front-1") == []


def test_a_non_streamed_request_is_sent_once_whole_when_it_finishes():
    routes = RequestRoutes()
    routes.add("b", b"front-2", stream=False)
    routes.add("c", b"front-2", stream=True)
    assert sorted(routes.owned_by(b"front-2")) == ["b", "c"]
    prompt = [None, lp(7)]
    assert routes.route(RequestOutput("b", [1, 2], "he", prompt_tokens=3, logprobs=[lp(1), lp(2)],
                                      prompt_logprobs=prompt)) is None
    assert routes.route(RequestOutput("b", [3], "llo", "length", 3, 3, 2, logprobs=[lp(3)])) == (
        b"front-2", RequestOutput("b", [1, 2, 3], "hello", "length", 3, 3, 2, logprobs=[lp(1), lp(2), lp(3)],
                                  prompt_logprobs=prompt))
    assert routes.owned_by(b"front-2") == ["c"] and not routes.pending


def test_an_unknown_or_forgotten_request_routes_nowhere():
    routes = RequestRoutes()
    assert routes.route(RequestOutput("x", [1], "a")) is None
    routes.add("y", b"f", stream=False)
    routes.route(RequestOutput("y", [1], "a"))
    routes.forget("y")
    assert routes.route(RequestOutput("y", [2], "b", "stop")) is None and not routes.pending
