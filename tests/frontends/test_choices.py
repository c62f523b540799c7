"""The n choices of one call: merged as they come, collected whole, closed on every path."""
from __future__ import annotations

import asyncio

import pytest

from frontends.choices import Merged, choice_params, collect
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams


class Stream:
    """A fake engine request stream: yields `outs` (an Exception instance is raised), records aclose()."""

    def __init__(self, outs, delay: float = 0.0):
        self.outs, self.delay, self.closed = outs, delay, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for o in self.outs:
            await asyncio.sleep(self.delay)
            if isinstance(o, Exception):
                raise o
            yield o

    async def aclose(self):
        self.closed = True


def out(text, finish=None, prompt=3, completion=1, cached=0):
    return RequestOutput("r", text=text, finish_reason=finish, prompt_tokens=prompt, completion_tokens=completion,
                         cached_tokens=cached)


def test_choice_params_offset_the_seed_per_choice_and_keep_none():
    p = SamplingParams(seed=7)
    assert [choice_params(p, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_params(SamplingParams(), 2).seed is None
    assert choice_params(SamplingParams(seed=2 ** 63 - 1), 1).seed == 0


async def test_collect_gathers_each_choice_whole_and_reports_each_finish():
    streams = [Stream([out("a"), out("b", "stop", completion=2)], 0.01),
               Stream([out("x", "length", completion=1, cached=2)])]
    finished = []
    done = await collect(Merged(streams), finished.append)
    assert [c.text for c in done] == ["ab", "x"]
    assert [c.final.finish_reason for c in done] == ["stop", "length"]
    assert sorted(o.finish_reason for o in finished) == ["length", "stop"]
    assert all(s.closed for s in streams)


async def test_an_error_in_one_choice_is_raised_and_every_stream_is_closed():
    streams = [Stream([out("a"), RuntimeError("engine gone")]), Stream([out("x")] * 100, 0.01)]
    with pytest.raises(RuntimeError, match="engine gone"):
        await collect(Merged(streams), lambda o: None)
    assert all(s.closed for s in streams)


async def test_merged_holds_at_most_one_output_per_stream():
    m = Merged([Stream([out(str(i)) for i in range(50)]), Stream([out("y")] * 50)])
    await asyncio.sleep(0.05)               # the pumps run ahead as far as the queue lets them
    assert m.queue.qsize() <= 2
    await m.aclose()
