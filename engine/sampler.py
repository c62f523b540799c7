"""Token sampling per request: greedy, temperature, top-k, top-p, seeds.

Sampling draws one uniform number per row and inverts the row's CDF (searchsorted over a cumulative
sum), instead of `torch.multinomial`, which draws one exponential per vocabulary entry (0.75 ms a row
for a 49k vocabulary here). Rows with only a temperature, the common case, are done as one batch.

A seeded request's k-th output token takes the k-th number of SplitMix64 seeded with its seed
(`seeded_uniform`): a pure function of (seed, k), kept by no one. So the same seed gives the same output
whatever else shares the batch, and also across a preemption, a failed step run again, or an engine
restart that resends the request with its earlier output (k counts that output too).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from ipc.outputs import TokenLogprobs
from ipc.sampling_params import SamplingParams


class History(NamedTuple):
    """What logit processing needs of a row's request: its prompt and output token ids (the penalties),
    the ids that would end it (EOS unless ignore_eos, and stop_token_ids) and how many tokens this
    request has generated (min_tokens holds the former back until the latter reaches it). The output can
    be longer than `generated` for a request resent after an engine restart (its earlier output)."""
    prompt: list[int]
    output: list[int]
    stop_ids: tuple[int, ...] = ()
    generated: int | None = None      # None: len(output)


class Sampler:
    """Samples one token per row of logits; unseeded rows draw from one engine-wide generator."""

    def __init__(self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """argmax: logits [B, vocab] -> [B] (a backend's; torch's by default)."""
        self.default = torch.Generator().manual_seed(seed)
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))

    def _uniforms(self, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
        """[len(params)] float32 in [0, 1): seeded_uniform for seeded rows, the default generator's otherwise."""
        u = torch.rand(len(params), generator=self.default)
        for j, (p, k) in enumerate(zip(params, indices)):
            if p.seed is not None:
                u[j] = seeded_uniform(p.seed, k)
        return u

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
               history: list[History] | None = None) -> list[int]:
        """logits: [B, vocab] (any float dtype) -> B token ids. indices: which output token of its request
        each row samples (0 for the first; a resent request's earlier output counts). history: each row's
        History, needed when some params process logits (SamplingParams.processes_logits)."""
        logits = process_logits(logits, params, history)
        tokens = self.argmax(logits)                                   # [B] int64, on the logits' device
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            # NOTE: drawn on the host, then moved: the same numbers on every device
            u = self._uniforms([params[i] for i in rows], [indices[i] for i in rows]).to(logits.device)
            temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
            probs = (logits[rows].float() / temps[:, None]).softmax(-1)
            for j, i in enumerate(rows):
                if params[i].top_k > 0 or params[i].top_p < 1.0:
                    probs[j] = _truncate(probs[j], params[i])
            tokens[torch.tensor(rows, device=tokens.device)] = _invert_cdf(probs, u)
        return tokens.tolist()          # NOTE: the step's one read back from the device: the token ids


MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, k: int) -> float:
    """The k-th (from 0) number of SplitMix64 seeded with `seed`, as a float in [0, 1) with 24 bits (exact
    in float32)."""
    z = (seed + (k + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 40) / (1 << 24)


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   history: list[History] | None) -> torch.Tensor:
    """logits [B, vocab] -> the same tensor, or an fp32 copy in which the rows whose params ask for it are processed:
    min_tokens, logit_bias, then repetition, frequency and presence penalties (see SamplingParams)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    assert history is not None, "penalties need each row's prompt and output tokens"
    logits = logits.to(torch.float32, copy=True)    # the caller's logits stay raw (for logprobs)
    for i in rows:
        p, (prompt, output, stop_ids, generated), row = params[i], history[i], logits[i]
        if (len(output) if generated is None else generated) < p.min_tokens and stop_ids:
            row[torch.tensor(stop_ids, device=row.device)] = float("-inf")
        if p.logit_bias:
            row.index_add_(0, torch.tensor(list(p.logit_bias), device=row.device),
                           torch.tensor(list(p.logit_bias.values()), device=row.device))
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if output and (p.frequency_penalty or p.presence_penalty):
            # NOTE: counted on the host, where the ids are: `unique` on a GPU would wait for the device
            counts = Counter(output)
            penalty = [p.frequency_penalty * c + p.presence_penalty for c in counts.values()]
            row.index_add_(0, torch.tensor(list(counts), device=row.device), torch.tensor(penalty, device=row.device),
                           alpha=-1)
    return logits


def logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """For rows whose params ask for logprobs: log_softmax of the row's logits (fp32, before temperature
    and truncation) at the sampled token, and the params.logprobs largest; None for the other rows."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = logits[rows].float().log_softmax(-1)                                   # [R, vocab]
    k = max(params[i].logprobs for i in rows)
    chosen, top_i, top_v = chosen_and_top(lp, [tokens[i] for i in rows], k)
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = TokenLogprobs(tokens[i], chosen[j], top_i[j][:n], top_v[j][:n])
    return out


def chosen_and_top(lp: torch.Tensor, tokens: list[int],
                   k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """lp: [R, vocab] log-probabilities; tokens: R ids -> each row's logprob at its token, and its k most
    likely ids and their logprobs. Read back from the device in three transfers, whatever R."""
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1)
    return chosen.tolist(), top_i.tolist(), top_v.tolist()


def _truncate(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """probs: [vocab] -> the same with every token outside top-k / top-p set to 0 (not renormalised)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if 0 < p.top_k < probs.numel():
        drop[p.top_k:] = True
    if p.top_p < 1.0:
        kept = sorted_probs.masked_fill(drop, 0.0)
        # keep the smallest prefix whose mass reaches top_p of the kept mass (always at least one token)
        drop |= kept.cumsum(-1) - kept >= p.top_p * kept.sum()
    return torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [B, vocab] non-negative (any scale); u: [B] in [0, 1) -> [B] int64 ids, id i with probability
    probs[i] / sum. Tokens of probability 0 are never returned."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)
