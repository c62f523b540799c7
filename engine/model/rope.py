"""Rotary position embedding as in Hugging Face Llama (rotate-half layout)."""
from __future__ import annotations

import math

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    if scaling.get("rope_type") == "linear":            # positions divided by the factor
        return inv / scaling["factor"]
    # llama3 frequency scaling
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class Rope:
    """cos/sin tables [max_len, head_dim] in the model dtype; `apply` rotates q and k in place."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.half = head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, 1, head_dim], gathered once per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated copy."""
        x1, x2 = x[..., : self.half], x[..., self.half:]
        rotated = torch.cat([-x2, x1], dim=-1)
        return x * cos + rotated * sin
