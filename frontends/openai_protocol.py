"""OpenAI's wire format: what typed requests (`api_types`) mean for the engine, and the responses."""
from __future__ import annotations

import json
import time
import uuid

from frontends.api_types import ChatCompletionRequest, CompletionRequest
from ipc.outputs import TokenLogprobs
from ipc.sampling_params import SamplingParams


class ApiError(Exception):
    """An error the client caused or should see, in OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(self.status,
                                                                                                 "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def logprobs_count(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives per token to report (0: the token's own logprob only), or None for no
    logprobs. Completions: `logprobs` (integer); chat: `logprobs` (boolean) with `top_logprobs`."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return None if not req.logprobs else (req.top_logprobs or 0)


def completion_logprobs(entries: list[TokenLogprobs], piece, offset: int) -> dict:
    """The legacy completions `logprobs` object; piece(id) -> the token's text; offset: characters of
    completion text before these tokens."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(piece(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(i): v for i, v in zip(e.top_ids, e.top_logprobs)} for e in entries],
            "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], prompt_lps: list[TokenLogprobs | None], piece) -> dict:
    """The echoed prompt's part of a completion's `logprobs`: one entry per prompt token, null where
    there is no logprob (the first token, which nothing predicts)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tok, e in zip(prompt_ids, prompt_lps):
        out["tokens"].append(piece(tok))
        out["token_logprobs"].append(None if e is None else e.logprob)
        out["top_logprobs"].append(None if e is None else {piece(i): v for i, v in zip(e.top_ids, e.top_logprobs)})
        out["text_offset"].append(offset)
        offset += len(out["tokens"][-1])
    return out


def join_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list[TokenLogprobs], piece) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    def one(i: int, v: float) -> dict:
        s = piece(i)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}
    return {"content": [{**one(e.token_id, e.logprob),
                         "top_logprobs": [one(i, v) for i, v in zip(e.top_ids, e.top_logprobs)]} for e in entries]}


# Fields of OpenAI's (or vLLM's) API this server does not implement, with the values that mean "off": a
# request that asks for one of them gets 400 naming it, rather than an answer that silently ignores it.
UNSUPPORTED = {"suffix": ("",), "best_of": (1,), "tools": ([],), "functions": ([],),
               "tool_choice": ("none",), "response_format": ({"type": "text"},), "use_beam_search": (False,),
               "prompt_logprobs": (), "guided_json": (), "guided_regex": (),
               "guided_choice": (), "guided_grammar": ()}


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    chat = isinstance(req, ChatCompletionRequest)
    fields = {**UNSUPPORTED, "echo": (False,)} if chat else UNSUPPORTED    # echo: completions only
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


def max_tokens(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, int] | None:
    """The field that bounds the completion's length and its value, if the request sets one."""
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return None if req.max_tokens is None else ("max_tokens", req.max_tokens)


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """ApiError (400) naming the first prompt token id outside the model's vocabulary (vocab_size 0: unknown,
    the engine checks)."""
    bad = next((t for t in ids if vocab_size and t >= vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is not in the model's vocabulary [0, {vocab_size})", "prompt")


def check_length(req: CompletionRequest | ChatCompletionRequest, prompt_len: int, limit: int, echo: bool) -> bool:
    """ApiError (400) unless the prompt has 1 to limit - 1 tokens and what the request asks to generate
    fits the rest of the context (`limit` tokens). -> prompt only: echo with max_tokens 0."""
    chat = isinstance(req, ChatCompletionRequest)
    field = "messages" if chat else "prompt"
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


def sampling_params(req: CompletionRequest | ChatCompletionRequest, default_max_tokens: int | None,
                    prompt_only: bool = False) -> SamplingParams:
    """The sampling fields of a completions or chat body. prompt_only: echo with max_tokens 0 (one token
    is computed and dropped)."""
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    asked = max_tokens(req)
    kw = dict(temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=_or(req.top_k, -1),
              seed=req.seed, max_tokens=1 if prompt_only else (asked[1] if asked else default_max_tokens),
              stop=stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=bool(req.ignore_eos),
              logprobs=logprobs_count(req), presence_penalty=_or(req.presence_penalty, 0.0),
              frequency_penalty=_or(req.frequency_penalty, 0.0),
              repetition_penalty=_or(req.repetition_penalty, 1.0), logit_bias=logit_bias(req.logit_bias),
              min_tokens=_or(req.min_tokens, 0))
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = max((f for f in kw if str(e).startswith(f)), key=len, default=None)   # stop_token_ids, not stop
        raise ApiError(400, str(e), param) from None


def _or(value, default):
    return default if value is None else value


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise ApiError(400, "'prompt' must be a string, or an array of token ids (batches are not supported)",
                           "prompt")
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    return [{"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
            for m in req.messages]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def choices_usage(finals: list, prompt_only: bool = False) -> dict:
    """The usage of one call from its choices' final outputs: the prompt once, the completions summed
    (none when only the prompt was asked for), the most cached tokens of any choice."""
    completion = 0 if prompt_only else sum(o.completion_tokens for o in finals)
    return usage(finals[0].prompt_tokens, completion, max(o.cached_tokens for o in finals))


def completion_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool, first: bool = False,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [choice]}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


def completion_response(rid: str, model: str, choices: list[tuple[str, str | None, dict | None]], chat: bool,
                        use: dict) -> dict:
    """choices: (text, finish_reason, logprobs object or None) per choice, in index order."""
    if chat:
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                             "logprobs": lps} for i, (text, finish, lps) in enumerate(choices)], "usage": use}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": lps}
                        for i, (text, finish, lps) in enumerate(choices)], "usage": use}
