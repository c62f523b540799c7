"""Per-request sampling settings, in vLLM's style."""
from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300   # entries of a logit_bias map
MAX_STOP_TOKEN_IDS = 256
MAX_CONSTRAINT_CHARS = 65536   # of a structured output's schema, regex, grammar or choices, as text


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """Constrain the output (vLLM's structured outputs), exactly one of: `json` a JSON schema (an object, or
    its text); `json_object` any JSON object; `regex` text the regular expression matches whole; `choice`
    one of these strings; `grammar` an EBNF grammar (xgrammar's dialect, GBNF-like, rule `root`). The
    engine compiles it for its tokenizer (engine/structured_output.py) and lets through, token by token,
    only tokens that keep the output a prefix of the language; once it is complete, only the end."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def validate(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, choice, grammar"
                             + (f"; got {', '.join(kinds)}" if kinds else ""))
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise ValueError("structured_outputs.choice: a non-empty list of non-empty strings")
        if len(msgspec.json.encode(self)) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs: at most {MAX_CONSTRAINT_CHARS} characters")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick tokens and when to stop.

    temperature 0 is greedy. top_k -1 (or 0) disables top-k; top_p 1 disables nucleus sampling.
    A `seed` makes sampling reproducible: same seed, same prompt, same output.
    Logit processing, in this order, before temperature (as vLLM and OpenAI): `min_tokens` bans EOS (unless
    `ignore_eos`) and `stop_token_ids` until the output has that many tokens; `logit_bias` adds a bias
    to given token ids; `repetition_penalty` (HF/CTRL style, 1 = off) divides the positive logits and
    multiplies the negative ones of every token seen in the prompt or the output; `frequency_penalty`
    subtracts penalty x count and `presence_penalty` subtracts penalty once, for each token already in
    the output. `structured_outputs` then keeps only the tokens its constraint allows, and ends the output
    where the constraint is complete (min_tokens and ignore_eos give way to it). Reported logprobs are those
    of the unprocessed logits. `prompt_logprobs` asks for every
    prompt token's logprob where it was predicted (the whole prompt is then computed: no prefix-cache hit).
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None   # report each token's logprob and this many most likely alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0            # EOS and stop_token_ids cannot be sampled before this many tokens
    prompt_logprobs: int | None = None   # each prompt token's logprob (but the first's) and this many alternatives
    structured_outputs: StructuredOutputsParams | None = None   # a JSON schema, a regex, choices or a grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > 64 or any(len(s) > 1024 for s in self.stop):
            raise ValueError("stop: at most 64 stop strings of at most 1024 characters")
        if any(not s for s in self.stop):
            raise ValueError("stop: empty stop strings are not allowed")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if t < 0 or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias: token ids must be non-negative and biases in [-100, 100], got {t}: {b}")

    @property
    def processes_logits(self) -> bool:
        """Whether logits go through logit_bias or a penalty before the token is picked."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0 or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
