"""The `n` choices of one API call: n engine requests (seed + i each), merged as their outputs come, or
collected whole for a non-streamed answer; and their usage."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from frontends.api_responses import PromptTokensDetails, Usage
from ipc.sampling_params import SamplingParams


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: with a seed, seed + i, so the choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + i) % 2 ** 63)


class Merged:
    """The outputs of several request streams (the `n` choices of one API call) as they come:
    (choice index, output). Errors of any stream are raised; aclose() stops and aborts them all. Its queue
    holds one output per stream: a slow consumer leaves the rest in each request's bounded client queue."""

    def __init__(self, gens: list):
        self.gens = gens
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=len(gens))
        self.ended = 0
        self.tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(gens)]

    def __len__(self) -> int:
        return len(self.gens)

    async def _pump(self, i: int, gen) -> None:
        try:
            async for out in gen:
                await self.queue.put((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await self.queue.put((i, None, e))
        else:
            await self.queue.put((i, None, None))     # this stream ended

    def __aiter__(self) -> "Merged":
        return self

    async def __anext__(self):
        while self.ended < len(self.gens):
            i, out, err = await self.queue.get()
            if err is not None:
                raise err
            if out is not None:
                return i, out
            self.ended += 1
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for g in self.gens:
            await g.aclose()


@dataclass
class Choice:
    """One choice collected whole: its text, its tokens' logprob entries, the prompt's logprobs (if
    asked) and its final output (None until it finished)."""
    text: str = ""
    entries: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    final: object = None


async def collect(gens: Merged, on_finish) -> list[Choice]:
    """Every choice of `gens` whole; on_finish(output) is called as each one finishes. Closes `gens`."""
    choices = [Choice() for _ in range(len(gens))]
    try:
        async for i, out in gens:
            c = choices[i]
            c.text += out.text
            c.entries += out.logprobs
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason is not None:
                c.final = out
                on_finish(out)
                if all(x.final is not None for x in choices):
                    break
    finally:
        await gens.aclose()
    return choices


def choices_usage(finals: list, n: int, prompt_only: bool = False) -> Usage:
    """The usage of one call from its choices' final outputs, every `n` of one prompt: each prompt once (and
    the most cached tokens of any of its choices), the completions summed (none when only the prompts were
    asked for)."""
    prompts = [finals[p:p + n] for p in range(0, len(finals), n)]
    prompt = sum(group[0].prompt_tokens for group in prompts)
    completion = 0 if prompt_only else sum(o.completion_tokens for o in finals)
    cached = sum(max(o.cached_tokens for o in group) for group in prompts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None)
