"""Turns a SchedulerOutput into tensors, runs the model and samples.

Owns the page pool's storage: one tensor [num_pages, page_elems] in the model dtype. A KV page holds
one block for every layer, laid out [layers, 2 (K, V), block]; the order inside a block is the backend's
(`Backend.kv_caches`: rows [block_size, kv_heads, head_dim] by default).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from engine import envs
from engine.config import EngineConfig
from engine.lora import dora
from engine.model.dora_scales import DoraScales
from engine.model.expert_lora import ExpertLora
from engine.model.llama import LlamaModel
from engine.model.weights import load_weights
from engine.sampler import History, Sampler, chosen_and_top, logprobs
from engine.scheduler import SchedulerOutput
from engine.structured_output import constrain
from ipc.outputs import TokenLogprobs
from kernels.attention_metadata import AttentionMetadata, MetadataBuilder
from kernels.backend import AdapterSlots, LoraStep
from kernels.memory import huge_zeros
from kernels.selector import configure_cpu_kernels, select_backend


@dataclass
class ForwardInput:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [S]
    sample_rows: list[int]         # S positions in SchedulerOutput.requests that sample this step
    prompt_rows: list[int] = field(default_factory=list)   # token rows whose logits score the next prompt token
    prompt_targets: list = field(default_factory=list)     # (request, index of that prompt token) per row


@dataclass
class ModelOutput:
    """What one step produced, by row of SchedulerOutput.requests: the sampled token of every row that
    finished its chunk, and the logprobs of those whose request asked for them."""
    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)


def page_elems(cfg: EngineConfig) -> int:
    m = cfg.model
    return m.num_layers * 2 * cfg.cache.block_size * m.num_kv_heads * m.head_dim


class ModelRunner:
    def __init__(self, cfg: EngineConfig, num_pages: int):
        self.cfg = cfg
        m = cfg.model
        self.block_size = cfg.cache.block_size
        configure_cpu_kernels(envs.cache_dir(), envs.cpu_kernels_enabled())
        self.backend = select_backend(cfg.backend, m, cfg.device, self.block_size)
        self.device = self.backend.device
        self.model = LlamaModel(m, load_weights(m, self.backend), self.backend, envs.c_decoder())
        if self.device.type == "cpu":
            self.storage = huge_zeros(num_pages, page_elems(cfg), dtype=m.dtype, populate=True)
        else:
            self.storage = torch.zeros(num_pages, page_elems(cfg), dtype=m.dtype, device=self.device)
        self.sampler = Sampler(cfg.seed, self.backend.argmax)
        self.placement = None       # adapter id -> (its PackedLayout, its pages): set by the engine (LoRA on)
        self.kv_caches = self.backend.kv_caches(self.storage, m.num_layers, self.block_size, m.num_kv_heads,
                                                m.head_dim)

    def prepare(self, out: SchedulerOutput) -> ForwardInput:
        ids, pos = [], []
        sample_rows, logits_idx, prompt_rows, prompt_targets = [], [], [], []
        b = self.backend
        attn = MetadataBuilder(self.block_size, b.every_token_a_row, b.query_tile_rows)
        for row, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            start = req.num_computed_tokens
            end = start + n
            q_start = len(ids)
            ids.extend(req.all_token_ids[start:end])
            pos.extend(range(start, end))
            attn.add(req.block_ids, start, n)
            if end == req.num_tokens:
                sample_rows.append(row)
                logits_idx.append(len(ids) - 1)
            if req.prompt_logprobs is not None:
                for p in range(start, min(end, req.num_prompt_tokens - 1)):
                    prompt_rows.append(q_start + p - start)
                    prompt_targets.append((req, p + 1))
        inp = ForwardInput(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), attn.build(),
                           torch.tensor(logits_idx, dtype=torch.long), sample_rows, prompt_rows, prompt_targets)
        return inp if self.device.type == "cpu" else _to_device(inp, self.device)

    def order(self, out: SchedulerOutput, adapters: AdapterSlots | None) -> None:
        """Lay the step's rows out, in place: decodes (one token each) first, as the attention metadata and
        the LoRA kernels take them, then by adapter slot, so that the LoRA path finds each adapter's tokens
        as one run of rows. The one sort of a step's rows."""
        def key(i: int) -> tuple[bool, int]:
            req = out.requests[i]
            slot = adapters.slot_of[req.adapter_id] if adapters is not None and req.adapter_id else -1
            return out.num_new_tokens[i] != 1, slot
        order = sorted(range(len(out.requests)), key=key)
        out.requests[:] = [out.requests[i] for i in order]
        out.num_new_tokens[:] = [out.num_new_tokens[i] for i in order]

    def lora_step(self, out: SchedulerOutput, adapters: AdapterSlots | None) -> LoraStep | None:
        """The step's LoRA from its rows (ordered by `order`): each token's slot, decodes first."""
        if adapters is None:
            return None
        token_slots = []
        for req, n in zip(out.requests, out.num_new_tokens):
            token_slots.extend([adapters.slot_of[req.adapter_id] if req.adapter_id else -1] * n)
        num_decode = sum(1 for n in out.num_new_tokens if n == 1)
        return self.backend.lora_step(adapters, token_slots, num_decode)

    def base_weight(self, layer: int, module: str) -> torch.Tensor:
        """The base model's weight of one projection, W [out, in] in the model dtype on the device: a view of
        its fused group's weight (what DoRA adapters' loads read, engine/lora/dora.py; any thread may call)."""
        group, first, end = dora.group_rows(self.cfg.model, module)
        layer_weights = self.model.w.layers[layer]
        linear = {"qkv": layer_weights.qkv, "o": layer_weights.o, "gate_up": layer_weights.gate_up,
                  "down": layer_weights.down}[group]
        if linear is None:
            raise ValueError(f"model: layer {layer} has no {module} (a mixture-of-experts layer)")
        return linear.weight[first:end]

    def dora_scales(self, out: SchedulerOutput) -> DoraScales | None:
        """The step's DoRA rescaling (engine/model/dora_scales.py), from the adapters' places in the pool."""
        if self.placement is None or not any(r.adapter_id and self.placement(r.adapter_id)[0].dora
                                             for r in out.requests):
            return None                     # (a row list over the step's tokens only when a DoRA row is in it)
        ids = [req.adapter_id or 0 for req, n in zip(out.requests, out.num_new_tokens) for _ in range(n)]
        return DoraScales.build(self.backend, self.storage, ids, self.placement)

    def expert_lora(self, out: SchedulerOutput) -> ExpertLora | None:
        """The step's LoRA on a mixture-of-experts model's experts (engine/model/expert_lora.py), from the
        adapters' places in the pool (`placement`, set by the engine: adapter id -> layout, pages)."""
        moe = self.cfg.model.moe
        if moe is None or self.placement is None:
            return None
        ids = [req.adapter_id or 0 for req, n in zip(out.requests, out.num_new_tokens) for _ in range(n)]
        return ExpertLora.build(self.storage, moe.num_experts, ids, self.placement)

    def execute(self, out: SchedulerOutput, adapters: AdapterSlots | None = None) -> ModelOutput:
        """Run one step over the scheduler's output (its rows reordered in place, `order`): the tokens sampled
        for rows that finished their chunk, and their logprobs. adapters: the backend's AdapterSlots."""
        self.order(out, adapters)
        lora = self.lora_step(out, adapters)
        experts = self.expert_lora(out)
        scales = self.dora_scales(out)
        inp = self.prepare(out)
        if inp.prompt_rows:
            logits, hidden = self.model.forward(inp.input_ids, inp.positions, inp.meta, self.kv_caches,
                                                inp.logits_indices, lora,
                                                torch.tensor(inp.prompt_rows, device=self.device), experts, scales)
            self._prompt_logprobs(hidden, inp.prompt_targets)
        else:
            logits = self.model.forward(inp.input_ids, inp.positions, inp.meta, self.kv_caches,
                                        inp.logits_indices, lora, experts=experts, dora=scales)
        if not inp.sample_rows:
            return ModelOutput()
        reqs = [out.requests[r] for r in inp.sample_rows]
        params = [r.params for r in reqs]
        history = [_history(r) for r in reqs] if any(p.processes_logits for p in params) else None
        raw = logits
        if any(r.grammar is not None for r in reqs):
            logits = constrain(logits, [r.grammar for r in reqs], self.backend.mask_logits_)
            # the constraint says where the output ends: min_tokens must not ban the one token it allows then
            params = [msgspec.structs.replace(p, min_tokens=0) if r.grammar is not None and p.min_tokens else p
                      for r, p in zip(reqs, params)]
        tokens = self.sampler.sample(logits, params, [r.num_resumed + len(r.output_token_ids) for r in reqs], history)
        lps = {row: lp for row, lp in zip(inp.sample_rows, logprobs(raw, tokens, params)) if lp is not None}
        return ModelOutput(dict(zip(inp.sample_rows, tokens)), lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list) -> None:
        """Fill each target's request.prompt_logprobs[i]: the logprob of prompt token i where it was
        predicted, and the request's params.prompt_logprobs most likely tokens there."""
        for lo in range(0, len(targets), PROMPT_LOGITS_ROWS):
            part = targets[lo:lo + PROMPT_LOGITS_ROWS]
            lp = self.model.logits_of(hidden[lo:lo + len(part)]).log_softmax(-1)
            k = max(req.params.prompt_logprobs for req, _ in part)
            chosen, top_i, top_v = chosen_and_top(lp, [req.prompt_token_ids[i] for req, i in part], k)
            for j, (req, i) in enumerate(part):
                n = req.params.prompt_logprobs
                req.prompt_logprobs[i] = TokenLogprobs(req.prompt_token_ids[i], chosen[j], top_i[j][:n], top_v[j][:n])


PROMPT_LOGITS_ROWS = 256   # prompt positions projected to the vocabulary at a time (~50 MB of fp32 logits)


def _history(r) -> History:
    """A request as logit processing sees it; a resumed request's earlier output counts as output."""
    cut = len(r.prompt_token_ids) - r.num_resumed
    stops = tuple(r.params.stop_token_ids) + (() if r.params.ignore_eos else tuple(r.eos_token_ids))
    return History(r.prompt_token_ids[:cut], r.prompt_token_ids[cut:] + r.output_token_ids, stops,
                   len(r.output_token_ids))


def _to_device(inp: ForwardInput, device: torch.device) -> ForwardInput:
    """The step's tensors, built on the host, copied to the device in one non-blocking transfer."""
    inp.input_ids, inp.positions, inp.logits_indices = inp.meta.to(device, inp.input_ids, inp.positions,
                                                                   inp.logits_indices)
    return inp
