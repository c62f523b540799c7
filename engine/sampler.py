"""Token sampling per request: greedy, temperature, top-k, top-p, seeded generators."""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row of logits. A request with a seed owns a generator seeded once, so the
    same seed gives the same output whatever else shares the batch."""

    def __init__(self, seed: int = 0):
        self.default = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        """logits: [B, vocab] (any float dtype) -> B token ids."""
        greedy = logits.argmax(dim=-1).tolist()
        out = list(greedy)
        for i, p in enumerate(params):
            if not p.greedy:
                out[i] = self._sample_row(logits[i].float(), p, self._generator(request_ids[i], p))
        return out

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = probs.cumsum(-1) - probs >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=gen).item())
