"""Engine vs transformers' batched generate: same process, same weights, same dtype.

64 requests, 128-token prompts, 128 new tokens each (EOS ignored). Prints output tokens/s of both and
the ratio. Usage: python bench/bench_engine.py [--dtype bfloat16] [--num 64] [--prompt-len 128] [--out-len 128]
"""
from __future__ import annotations

import argparse
import time

import torch


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (num, length), generator=g).tolist()


def _best_time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_bound(args, weights) -> float:
    """Seconds the same workload spends in the base model's GEMMs alone, timed with the engine's own
    weights: prefill steps of max_batched_tokens rows, then one M=num decode step per new token."""
    prefill_rows = args.num * args.prompt_len
    full, rest = divmod(prefill_rows, args.max_batched_tokens)
    decode_steps = args.out_len - 1            # the first new token comes out of the prefill
    total = 0.0
    for rows, count in [(args.max_batched_tokens, full), (rest, 1 if rest else 0), (args.num, decode_steps)]:
        if count == 0:
            continue
        layer = weights.layers[0]
        xs = {n: torch.randn(rows, n).to(weights.embed.dtype) for n in {layer.qkv.in_features, layer.down.in_features}}
        per_layer = sum(_best_time(lambda lin=lin: lin(xs[lin.in_features]))
                        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        total += count * per_layer * len(weights.layers)
    head_rows = torch.randn(args.num, weights.lm_head.in_features).to(weights.embed.dtype)
    total += (decode_steps + 1) * _best_time(lambda: weights.lm_head(head_rows))
    return total


def kv_read_bound(args, llm) -> tuple[float, int, float]:
    """Seconds the decode steps need just to read the K/V they attend to, at the best read bandwidth
    measured here (a plain sum over the KV pool): step i reads num * (prompt_len + i) tokens' K/V."""
    m = llm.engine.cfg.model
    per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * llm.engine.runner.storage.element_size()
    tokens = sum(args.num * (args.prompt_len + i) for i in range(1, args.out_len))
    storage = llm.engine.runner.storage
    bw = storage.numel() * storage.element_size() / _best_time(lambda: storage.sum())
    return tokens * per_token / bw, tokens * per_token, bw


def bench_engine(args, prompts) -> tuple[float, float, float]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(dtype=args.dtype, max_num_seqs=args.num, max_num_batched_tokens=args.max_batched_tokens,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))   # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    assert n == args.num * args.out_len
    print(f"loraplex     : {n} tokens in {dt:7.2f} s = {n / dt:8.1f} tok/s")
    bound = gemm_bound(args, llm.engine.runner.model.w)
    print(f"  of which the base GEMMs alone take ~{bound:.2f} s (timed separately): a run of nothing but "
          f"GEMMs would give {n / bound:.1f} tok/s")
    kv_s, kv_bytes, bw = kv_read_bound(args, llm)
    print(f"  decode attention must read {kv_bytes / 1e9:.1f} GB of K/V: {kv_s:.2f} s at this machine's "
          f"{bw / 1e9:.1f} GB/s (a plain read of the KV pool); GEMMs + K/V reads: {n / (bound + kv_s):.1f} tok/s")
    return n / dt, n / bound, n / (bound + kv_s)


def bench_hf(args, prompts) -> float:
    from transformers import AutoModelForCausalLM
    from engine.model.resolve import resolve_model
    path, _ = resolve_model("default")
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=4, **{**kw, "attention_mask": torch.ones_like(ids[:2])})
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.out_len, min_new_tokens=args.out_len, **kw)
        dt = time.perf_counter() - t
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    print(f"transformers : {n} tokens in {dt:7.2f} s = {n / dt:8.1f} tok/s")
    return n / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out-len", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    prompts = make_prompts(args.num, args.prompt_len, 49152)
    print(f"{args.num} requests x ({args.prompt_len} prompt + {args.out_len} new tokens), {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    ours, gemm_only, gemm_kv = bench_engine(args, prompts)
    if not args.skip_hf:
        theirs = bench_hf(args, prompts)
        print(f"ratio        : {ours / theirs:.2f}x transformers (bounds: GEMMs alone {gemm_only / theirs:.2f}x, "
              f"GEMMs + K/V reads {gemm_kv / theirs:.2f}x)")


if __name__ == "__main__":
    main()
