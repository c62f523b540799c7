"""The offline Python API, in vLLM's style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from typing import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import CompletionOutput, RequestOutput
from engine.tokenizer import encode_chat, load_tokenizer
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """One engine in this process. Keyword arguments are EngineConfig settings (`dtype`, `backend`
    ("auto", "torch", "cpu", "triton"), `max_num_seqs`, `max_num_batched_tokens`, `kv_cache_memory_bytes`,
    `block_size`, ...)."""

    def __init__(self, model: str = "default", dtype: str = "bfloat16", **kwargs):
        self.config = EngineConfig.create(model=model, dtype=dtype, **kwargs)
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.engine = EngineCore(self.config)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.closed = False

    def close(self) -> None:
        """Stop the adapter loader's and digester's threads (loads not started are cancelled, a running one
        finishes first); idempotent. The LLM generates no more after it. `with LLM(...) as llm:` closes it
        on leaving the block."""
        self.closed = True
        if self.engine.adapters is not None:
            self.engine.adapters.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("prompt: must be a string or a list of token ids")

    def register_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Register a PEFT LoRA directory under `name` (validated now; loaded on first use)."""
        self.engine.register_adapter(name, path, pinned)

    def unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def stats(self) -> dict:
        """The engine's report: pool pages by kind, adapter tiers, loads, evictions, hit rate, ..."""
        return self.engine.report()

    def list_adapters(self) -> list[str]:
        return self.engine.adapters.names() if self.engine.adapters else []

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); outputs in prompt order.
        `adapter`: one adapter name (or None, the base model) for all prompts, or a list with one per prompt;
        an adapter may also be a composition, a list of (name, weight) pairs: W x + sum_i weight_i * (alpha_i
        / r_i) * B_i A_i x (at most max_adapters_per_request of them; engine/lora/compose.py)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._tokens(p) for p in prompts]
        return self._run(token_lists, [p if isinstance(p, str) else None for p in prompts], params, adapter, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             adapter: str | None | Sequence[str | None] = None, use_tqdm: bool = False,
             tools: list[dict] | None = None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`'s text, or the model's) to each conversation and generate;
        `tools` (OpenAI's function definitions) and `chat_template_kwargs` reach the template, as vLLM's
        `LLM.chat`; continue_final_message: the last turn goes on instead of being answered."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [encode_chat(self.tokenizer, c, tools, chat_template, chat_template_kwargs,
                                   continue_final_message) for c in convs]
        return self._run(token_lists, [None] * len(convs), params, adapter, use_tqdm)

    @staticmethod
    def _per_prompt(value, n: int, name: str) -> list:
        one = not isinstance(value, (list, tuple)) or (name == "adapter" and _is_composition(value))
        values = [value] * n if one else list(value)
        if len(values) != n:
            raise ValueError(f"{name}: {len(values)} given for {n} prompts")
        return values

    def _run(self, token_lists, texts, params, adapter, use_tqdm) -> list[RequestOutput]:
        if self.closed:
            raise RuntimeError("this LLM is closed (close() or its `with` block ended): make a new one")
        plist = self._per_prompt(params or SamplingParams(), len(token_lists), "params")
        alist = self._per_prompt(adapter, len(token_lists), "adapter")
        results: dict[str, RequestOutput] = {}
        reqs = []
        for ids, text, p, a in zip(token_lists, texts, plist, alist):
            rid = f"offline-{next(self._ids)}"
            if isinstance(a, (list, tuple)):         # a composition: (name, weight) pairs
                reqs.append(GenerateRequest(rid, ids, p, adapters=[(str(n), float(w)) for n, w in a]))
            else:
                reqs.append(GenerateRequest(rid, ids, p, adapter=a))
            self.engine.validate(reqs[-1])
            self.engine.request_adapter_id(reqs[-1])
            results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(
                0, "", [], None, logprobs=[] if p.logprobs is not None else None)])
        for req in reqs:
            p = req.params
            self.engine.add_request(req)
            self.processor.add(req.request_id, req.prompt_token_ids, p.stop, p.include_stop_str_in_output)
        bar = tqdm(total=len(results), desc="generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for d in self.processor.step(self.engine):
                    out = results[d.request_id].outputs[0]
                    out.text += d.text
                    out.token_ids.extend(d.token_ids)
                    if out.logprobs is not None:
                        out.logprobs.extend(_as_dict(t) for t in d.logprobs)
                    if d.prompt_logprobs is not None:
                        results[d.request_id].prompt_logprobs = [None if t is None else _as_dict(t)
                                                                 for t in d.prompt_logprobs]
                    results[d.request_id].num_cached_tokens = d.cached_tokens
                    if d.finish_reason is not None:
                        out.finish_reason = d.finish_reason
                        out.error = d.error
                        bar.update()
            self.engine.settle()            # idle now, as a server between requests
        finally:
            bar.close()
            for rid in results:
                if self.engine.abort(rid):
                    self.processor.drop(rid)
        return list(results.values())


def _as_dict(t) -> dict[int, float]:
    """A TokenLogprobs as vLLM's offline API shows it: {token id: logprob} for it and the alternatives."""
    return {t.token_id: t.logprob, **dict(zip(t.top_ids, t.top_logprobs))}


def _is_composition(value) -> bool:
    """A list of (name, weight) pairs (and not a list of per-prompt adapters)."""
    return bool(value) and all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                               and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) for p in value)
