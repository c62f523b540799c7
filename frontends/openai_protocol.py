"""OpenAI's wire format: validate request bodies (errors name the field) and build responses."""
from __future__ import annotations

import json
import time
import uuid

from ipc.outputs import TokenLogprobs
from ipc.sampling_params import MAX_LOGPROBS, SamplingParams


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


def field(body: dict, name: str, types, default=None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"'{name}' is required", name)
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{name}' must be of type {_names(types)}", name)
    if not isinstance(value, types):
        raise ApiError(400, f"'{name}' must be of type {_names(types)}", name)
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value < _INT64[1]:
        raise ApiError(400, f"'{name}' is out of range, got {value}", name)
    return value


_INT64 = (-2 ** 63, 2 ** 63)   # what the engine's messages carry


def token_ids(value, name: str) -> list[int]:
    """A list of token ids (non-negative integers; the engine checks them against its vocabulary)."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"'{name}' must be an array of token ids", name)
    bad = next((t for t in value if not 0 <= t < _INT64[1]), None)
    if bad is not None:
        raise ApiError(400, f"'{name}': token ids must be non-negative integers below 2**63, got {bad}", name)
    return value


def _names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
                        dict: "object"}[t] for t in types)


def logprobs_field(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to report (0: the token's own logprob only), or None for no
    logprobs. Completions: `logprobs` (integer); chat: `logprobs` (boolean) with `top_logprobs`."""
    if not chat:
        n = field(body, "logprobs", int, None)
        top = "logprobs"
    else:
        n = 0 if field(body, "logprobs", bool, False) else None
        k = field(body, "top_logprobs", int, None)
        if k is not None and n is None:
            raise ApiError(400, "'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        n, top = (k if k is not None else n), "top_logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"'{top}' must be between 0 and {MAX_LOGPROBS}, got {n}", top)
    return n


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


def refuse_unsupported(body: dict, chat: bool) -> None:
    fields = {**UNSUPPORTED, "echo": (False,)} if chat else UNSUPPORTED    # echo: completions only
    for name, off in fields.items():
        value = body.get(name)
        if value is None or any(value == o and type(value) is type(o) for o in off):
            continue
        if name == "best_of" and value == body.get("n", 1):
            continue                       # best_of equal to n: every candidate is returned
        raise ApiError(400, f"'{name}' is not supported by this server (got {json.dumps(value)[:80]})", name)


def logit_bias_field(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object from token ids (as strings) to biases."""
    raw = field(body, "logit_bias", dict, {}) or {}
    out = {}
    for k, v in raw.items():
        try:
            out[int(k)] = float(v)
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, f"'logit_bias' maps token ids to numbers, got {k!r}: {v!r}", "logit_bias") from None
    token_ids(list(out), "logit_bias")
    return out


def sampling_params(body: dict, default_max_tokens: int | None, chat: bool = False) -> SamplingParams:
    """The sampling fields of a completions or chat body."""
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of strings", "stop")
    max_tokens = field(body, "max_completion_tokens", int, None) or field(body, "max_tokens", int, default_max_tokens)
    kw = dict(temperature=float(field(body, "temperature", (int, float), 1.0)),
              top_p=float(field(body, "top_p", (int, float), 1.0)), top_k=field(body, "top_k", int, -1),
              seed=field(body, "seed", int, None), max_tokens=max_tokens, stop=stop,
              stop_token_ids=token_ids(field(body, "stop_token_ids", list, []), "stop_token_ids"),
              ignore_eos=field(body, "ignore_eos", bool, False),
              logprobs=logprobs_field(body, chat),
              presence_penalty=float(field(body, "presence_penalty", (int, float), 0.0)),
              frequency_penalty=float(field(body, "frequency_penalty", (int, float), 0.0)),
              repetition_penalty=float(field(body, "repetition_penalty", (int, float), 1.0)),
              logit_bias=logit_bias_field(body), min_tokens=field(body, "min_tokens", int, 0))
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = max((f for f in kw if str(e).startswith(f)), key=len, default=None)   # stop_token_ids, not stop
        raise ApiError(400, str(e), param) from None


MAX_CHOICES = 16


def choice_count(body: dict) -> int:
    """`n`: how many completions to generate for the prompt (each its own engine request)."""
    n = field(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    return n


def stream_options(body: dict) -> bool:
    opts = field(body, "stream_options", dict, {})
    return bool(opts.get("include_usage", False))


def completion_prompt(body: dict) -> str | list[int]:
    prompt = field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(400, "'prompt' must be a string, or an array of token ids (batches are not supported)",
                           "prompt")
        token_ids(prompt, "prompt")
    return prompt


def chat_messages(body: dict) -> list[dict]:
    messages = field(body, "messages", list, required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


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
