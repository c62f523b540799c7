"""Structured outputs: a request's constraint (ipc StructuredOutputsParams: a JSON schema, any JSON object, a
regex, choices or an EBNF grammar) compiled by xgrammar for the engine's tokenizer, and a matcher per request
that masks, each step, the tokens that would leave the language and follows the tokens sampled.

Compiling a usual constraint takes a few milliseconds (a cache keeps the last COMPILED_CACHE); the offline
LLM compiles here, the server in a child process it can kill (engine/serving/compile_worker.py) and
install()s the result. The tokenizer's table is built once, at the first constrained request (~0.2 s, and
xgrammar's import ~2 s). Masks are applied to a copy of the logits in their own dtype (-inf is exact in
bf16): logprobs stay those of the raw logits, as for logit_bias and the penalties. JSON is compact (no free
whitespace between tokens): a model cannot loop on blanks until max_tokens.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

import msgspec
import torch

from ipc.sampling_params import StructuredOutputsParams

COMPILED_CACHE = 256


class Grammars:
    """Compiled constraints for one model's tokenizer (vocabulary `vocab_size`, the logits' width; `eos`: the
    ids that end a request). Thread-safe: requests are added on the event loop, steps run on another thread."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos: tuple[int, ...]):
        self.tokenizer_path, self.vocab_size, self.eos = tokenizer_path, vocab_size, eos
        self._compiler = self._info = None
        self._compiled: OrderedDict[bytes, object] = OrderedDict()
        self._lock = threading.Lock()             # the cache
        self._init_lock = threading.Lock()        # the compiler, made at the first constrained request

    def matcher(self, spec: StructuredOutputsParams, earlier: list[int] = ()) -> Matcher:
        """A matcher for `spec` that has followed `earlier` output tokens (a request resent after an engine
        restart); ValueError naming what is wrong with the constraint."""
        import xgrammar as xgr
        m = Matcher(xgr.GrammarMatcher(self.compiled(spec)), self.vocab_size)
        for t in earlier:
            if not m.accept(t):
                raise ValueError("structured_outputs: the request's earlier output does not fit its constraint")
        return m

    def is_compiled(self, spec: StructuredOutputsParams) -> bool:
        with self._lock:
            return msgspec.json.encode(spec) in self._compiled

    def compiled(self, spec: StructuredOutputsParams):
        """`spec` compiled (from the cache, or now, in this thread); ValueError naming what is wrong with it.
        Compiles run outside the lock: a slow one holds up no cache lookup. (The server compiles in a child
        process instead, engine/serving/compile_worker.py, and install()s the result.)"""
        key = msgspec.json.encode(spec)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        grammar = self.compile_new(spec)
        self._keep(key, grammar)
        return grammar

    def install(self, spec: StructuredOutputsParams, serialized: str) -> None:
        """Keep a grammar compiled elsewhere (xgrammar's CompiledGrammar.serialize_json of `spec`)."""
        import xgrammar as xgr
        self._keep(msgspec.json.encode(spec), xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info()))

    def _keep(self, key: bytes, grammar) -> None:
        with self._lock:
            self._compiled[key] = grammar
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)

    def compile_new(self, spec: StructuredOutputsParams):
        """`spec` compiled now (no cache); ValueError naming what is wrong with it."""
        import json

        import xgrammar as xgr
        c = self._compiler_()
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return c.compile_json_schema(schema, any_whitespace=False)
            if spec.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                rule = " | ".join(json.dumps(c) for c in spec.choice)     # EBNF strings are JSON-escaped
                return c.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {rule}"))
            return c.compile_grammar(xgr.Grammar.from_ebnf(spec.grammar))
        except Exception as e:  # noqa: BLE001 - whatever the compiler says of a bad constraint is the client's 400
            kind = next(k for k in ("json", "regex", "choice", "grammar") if getattr(spec, k) is not None) \
                if not spec.json_object else "json_object"
            raise ValueError(f"structured_outputs.{kind}: {_reason(e)}") from None

    def tokenizer_info(self):
        """xgrammar's table of the tokenizer's tokens (built once: ~0.2 s)."""
        with self._init_lock:
            if self._info is None:
                import xgrammar as xgr

                from engine.tokenizer import load_tokenizer
                self._info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self.tokenizer_path),
                                                                vocab_size=self.vocab_size,
                                                                stop_token_ids=list(self.eos))
            return self._info

    def _compiler_(self):
        info = self.tokenizer_info()
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def _reason(error: Exception) -> str:
    """xgrammar's message, first line, without its time and source location ("[12:41:26] /x/y.cc:94: ")
    or its assertion ("Check failed: (error.empty()) is false: ")."""
    text = _WHERE.sub("", str(error).strip(), count=1)
    return _CHECK.sub("", text, count=1).split("\n")[0]


_WHERE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK = re.compile(r"^Check failed: .*? is false:\s*")


class Matcher:
    """One request's place in its constraint."""

    def __init__(self, matcher, vocab_size: int):
        self.m, self.vocab_size = matcher, vocab_size

    def accept(self, token: int) -> bool:
        """Follow a sampled token; False if the constraint does not allow it (then nothing changed)."""
        return self.m.accept_token(token)

    @property
    def done(self) -> bool:
        """The output is complete and its end was accepted."""
        return self.m.is_terminated()


def constrain(logits: torch.Tensor, matchers: list[Matcher | None], mask_logits_) -> torch.Tensor:
    """logits [B, vocab] -> a copy (same dtype) in which, for each row with a matcher, the tokens its
    constraint does not allow next are -inf (the others untouched; -inf is exact in any float dtype, so a
    greedy row picks the allowed token the raw logits rank first). mask_logits_: the backend's
    (Backend.mask_logits_)."""
    import xgrammar as xgr
    rows = [i for i, m in enumerate(matchers) if m is not None]
    mask = xgr.allocate_token_bitmask(len(matchers), matchers[rows[0]].vocab_size)      # [B, vocab / 32] int32
    _batch().batch_fill_next_token_bitmask([matchers[i].m for i in rows], mask, indices=rows)
    return mask_logits_(logits.clone(memory_format=torch.contiguous_format), mask, rows)


_BATCH = None


def _batch():
    """xgrammar's batch filler, on one thread: the step's compute threads are busy around it."""
    global _BATCH
    if _BATCH is None:
        import xgrammar as xgr
        _BATCH = xgr.BatchGrammarMatcher(max_threads=1)
    return _BATCH
