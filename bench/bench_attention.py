"""Paged attention of one step, a backend's kernel against the reference backend (torch SDPA over gathered
blocks), both measured in one run on the same device and the same cache contents.

Scenarios (the default model's attention shape: 9 query heads, 3 KV heads, head_dim 64, block 32):
  decode   64 requests decoding at a context of 1,024
  prefill  4 prompts of 512 tokens, whole
  mixed    32 decodes at 1,024 and a 256-token chunk of a prompt at offset 768
  long     one request decoding at a context of 8,192
Each scenario writes every context token's K/V through each backend (random, seeded: both caches hold
the same values), checks the two outputs agree, then times one step's attention over --layers layers
(each its own cache), the two sides alternated --repeats times; prints the best of each and the ratio.
Usage: python -m bench.bench_attention [--device auto] [--backend auto] [--dtype bfloat16]
On a CPU the backend is the C kernels' (`cpu`); on CUDA, Triton's.
"""
from __future__ import annotations

import argparse
import time

import torch

from engine.config import ModelConfig
from kernels.attention_metadata import AttentionMetadata, MetadataBuilder
from kernels.backend import Backend
from kernels.selector import resolve_device, select_backend

SCENARIOS = {"decode": [(1024, 1)] * 64, "prefill": [(0, 512)] * 4, "mixed": [(1024, 1)] * 32 + [(768, 256)],
             "long": [(8192, 1)]}


def default_shape(dtype: torch.dtype) -> ModelConfig:
    """The default model's shape (SmolLM2-135M); attention reads only its heads, head_dim and dtype."""
    return ModelConfig(path="", name="SmolLM2-135M", dtype=dtype, vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, max_model_len=8192,
                       tie_word_embeddings=True, eos_token_ids=(2,))


class Side:
    """One backend with its own page pool of `layers` layers, filled with the same K/V as the other's."""

    def __init__(self, backend: Backend, seqs, block_size: int, layers: int, seed: int):
        s, dev = backend.shape, backend.device
        self.backend, self.block_size = backend, block_size
        blocks = [-(-(start + n) // block_size) for start, n in seqs]
        self.tables = [list(range(sum(blocks[:i]), sum(blocks[:i + 1]))) for i in range(len(seqs))]
        page = layers * 2 * block_size * s.num_kv_heads * s.head_dim
        self.storage = torch.zeros(sum(blocks), page, dtype=s.dtype, device=dev)
        self.caches = backend.kv_caches(self.storage, layers, block_size, s.num_kv_heads, s.head_dim)
        whole = self.meta([(0, start + n) for start, n in seqs])
        g = torch.Generator().manual_seed(seed)
        for k_cache, v_cache in self.caches:
            k, v = (torch.randn(whole.slot_page.shape[0], s.num_kv_heads, s.head_dim, generator=g).to(s.dtype)
                    for _ in range(2))
            backend.write_kv(k_cache, v_cache, k.to(dev), v.to(dev), whole)
        self.step = self.meta(seqs)

    def meta(self, seqs) -> AttentionMetadata:
        b = self.backend
        builder = MetadataBuilder(self.block_size, b.every_token_a_row, b.query_tile_rows)
        for (start, n), table in zip(seqs, self.tables):
            builder.add(table, start, n)
        meta = builder.build()
        meta.to(self.backend.device)
        return meta

    def run(self, q: torch.Tensor) -> list[torch.Tensor]:
        """One step's attention, every layer: q [T, heads, head_dim] -> each layer's output."""
        self.step.decode_masks = {}          # a backend's per-step cache (built on the first layer)
        scale = self.backend.shape.head_dim ** -0.5
        return [self.backend.attention(q, k, v, self.step, scale) for k, v in self.caches]


def timed(side: Side, q: torch.Tensor) -> float:
    sync = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    side.run(q)
    sync()
    return time.perf_counter() - t


def scenario(name: str, args, device: torch.device) -> float:
    dtype = getattr(torch, args.dtype)
    seqs = SCENARIOS[name]
    shape = default_shape(dtype)
    sides = [Side(select_backend(b, shape, device, args.block_size), seqs, args.block_size, args.layers, seed=0)
             for b in (args.backend, "torch")]
    q = torch.randn(sum(n for _, n in seqs), shape.num_heads, shape.head_dim,
                    generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    got, want = (side.run(q)[-1].float() for side in sides)
    err = (got - want).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"{name}: the two sides differ by {err}"
    best = [float("inf")] * 2
    for _ in range(args.repeats):
        for i, side in enumerate(sides):
            best[i] = min(best[i], timed(side, q))
    tokens = q.shape[0]
    per_layer = [b / args.layers * 1e3 for b in best]
    print(f"{name:8s} {len(seqs):3d} requests, {tokens:5d} query rows: {sides[0].backend.name} "
          f"{per_layer[0]:8.3f} ms vs torch {per_layer[1]:8.3f} ms a layer = {best[1] / best[0]:6.2f}x "
          f"(max |diff| {err:.1e})")
    return best[1] / best[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--backend", default="auto", help="auto (cpu on a CPU, triton on CUDA), cpu or triton")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=4, help="layers a step (each its own cache)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.backend == "auto":
        args.backend = "triton" if device.type == "cuda" else "cpu"
    torch.manual_seed(0)
    print(f"bench_attention: device {device}, {args.backend} vs torch, {args.dtype}, block {args.block_size}, "
          f"{args.layers} layers, best of {args.repeats}")
    for name in SCENARIOS if args.scenario == "all" else [args.scenario]:
        scenario(name, args, device)


if __name__ == "__main__":
    main()
