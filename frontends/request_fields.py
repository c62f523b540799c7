"""What the fields of a generation request (completions or chat) mean for the engine: its sampling
parameters, its length checks, and the OpenAI fields this server refuses by name. Each check raises
ApiError (400) naming the field at fault."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

from frontends.api_error import ApiError
from frontends.api_requests import Generation
from frontends.structured_fields import structured_outputs
from ipc.sampling_params import SamplingParams

# Fields of OpenAI's (or vLLM's) API this server does not implement, with the values that mean "off": a
# request that asks for one of them gets 400 naming it, rather than an answer that silently ignores it.
UNSUPPORTED = {"suffix": ("",), "best_of": (1,), "tools": ([],), "functions": ([],),
               "tool_choice": ("none",), "use_beam_search": (False,), "prompt_logprobs": ()}


def refuse_unsupported(req: Generation, fields: dict[str, tuple]) -> None:
    """400 naming the first of `fields` (name -> the values meaning off) that the request turns on."""
    for name, off in fields.items():
        value = getattr(req, name)
        if value is None or any(value == o and type(value) is type(o) for o in off):
            continue
        if name == "best_of" and value == (req.n or 1) and type(value) is int:
            continue                       # best_of equal to n: every candidate is returned
        raise ApiError(400, f"'{name}' is not supported by this server (got {json.dumps(value)[:80]})", name)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object from token ids (as strings) to biases."""
    out = {}
    for k, v in (raw or {}).items():
        try:
            t = int(k)
        except ValueError:
            t = -1
        if not 0 <= t < 2 ** 63:
            raise ApiError(400, f"'logit_bias' maps token ids (non-negative integers below 2**63) to numbers, "
                           f"got {k[:40]!r}", "logit_bias")
        out[t] = v
    return out


def max_tokens(req: Generation) -> tuple[str, int] | None:
    """The field that bounds the completion's length and its value, if the request sets one."""
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return None if req.max_tokens is None else ("max_tokens", req.max_tokens)


@contextmanager
def batch_member(p: int, count: int) -> Iterator[None]:
    """An ApiError raised inside names prompt p of a batch of `count` prompts (one prompt: as it is)."""
    try:
        yield
    except ApiError as e:
        if count > 1:
            e.message = f"prompt {p} of the batch: {e.message}"
        raise


def check_choices(tenant, prompts: int, n: int) -> None:
    """400 when a call asks for more choices (prompts x n engine requests) than its tenant may have waiting:
    it could never be admitted whole, so a 429 would be retried for ever."""
    total = prompts * n
    if tenant is not None and tenant.max_waiting and total > tenant.max_waiting:
        raise ApiError(400, f"this call asks for {total} choices ({prompts} prompts x n {n}); tenant "
                       f"{tenant.name!r} may have {tenant.max_waiting} waiting (its max_waiting)", "n")


def check_token_ids(ids: list[int], vocab_size: int, field: str = "prompt") -> None:
    """400 naming the first token id of request field `field` outside the model's vocabulary (vocab_size 0:
    unknown, the engine checks)."""
    bad = next((t for t in ids if vocab_size and t >= vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is not in the model's vocabulary [0, {vocab_size})", field)


def check_length(req: Generation, prompt_len: int, limit: int, field: str, echo: bool) -> bool:
    """400 unless the prompt (request field `field`) has 1 to limit - 1 tokens and what the request asks
    to generate fits the rest of the context (`limit` tokens). -> prompt only: echo with max_tokens 0."""
    if not prompt_len:
        raise ApiError(400, "the prompt is empty: it needs at least one token", field)
    if prompt_len >= limit:
        raise ApiError(400, f"the prompt is {prompt_len} tokens; this model's context is {limit} tokens",
                       field, "context_length_exceeded")
    asked, wanted = max_tokens(req) or (None, 0)
    if asked and wanted > limit - prompt_len and not (echo and wanted == 0):
        raise ApiError(400, f"'{asked}' is {wanted}, but the prompt is {prompt_len} tokens and this model's "
                       f"context is {limit}: at most {limit - prompt_len} can be generated", asked,
                       "context_length_exceeded")
    return echo and asked == "max_tokens" and wanted == 0


def sampling_params(req: Generation, logprobs: int | None, default_max_tokens: int | None,
                    prompt_only: bool = False, tool_constraint=None) -> SamplingParams:
    """The sampling fields of a request; logprobs: alternatives per token to report (None: no logprobs).
    prompt_only: echo with max_tokens 0 (one token is computed and dropped). tool_constraint: the output's
    constraint that `tool_choice` sets (chat), which no other constraint may join."""
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    asked = max_tokens(req)
    constraint, source = structured_outputs(req)
    if tool_constraint is not None:
        if constraint is not None:
            raise ApiError(400, f"tool_choice {json.dumps(_choice(req))} and {source}: give one constraint on "
                           f"the output, not 2", source)
        constraint, source = tool_constraint, "tool_choice"
    kw = dict(temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=_or(req.top_k, -1),
              seed=req.seed, max_tokens=1 if prompt_only else (asked[1] if asked else default_max_tokens),
              stop=stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=bool(req.ignore_eos),
              logprobs=logprobs, presence_penalty=_or(req.presence_penalty, 0.0),
              frequency_penalty=_or(req.frequency_penalty, 0.0),
              repetition_penalty=_or(req.repetition_penalty, 1.0), logit_bias=logit_bias(req.logit_bias),
              min_tokens=_or(req.min_tokens, 0), structured_outputs=constraint)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = max((f for f in kw if str(e).startswith(f)), key=len, default=None)   # stop_token_ids, not stop
        raise ApiError(400, str(e), source if param == "structured_outputs" else param) from None


def constraint_field(req: Generation, tool_constraint=None) -> str | None:
    """The request field the output's constraint came from (a tool call's schema: `tools`), or None."""
    if tool_constraint is not None:
        return "tools"
    return structured_outputs(req)[1]


def _choice(req) -> str:
    choice = req.tool_choice
    return choice if isinstance(choice, str) else f"function {choice.function.name}"


def _or(value, default):
    return default if value is None else value
