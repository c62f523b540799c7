"""Engine vs transformers' batched generate: same process, same weights, same dtype.

64 requests, 128-token prompts, 128 new tokens each (EOS ignored). Prints output tokens/s of both and
the ratio of the best of each over alternated runs. Usage: python bench/bench_engine.py [--dtype bfloat16]
[--num 64] [--prompt-len 128] [--out-len 128] [--repeats 3]

With --tiles: the engine with its GEMM tiles on AMX against the same engine on vdpbf16ps (AVX512-BF16), runs
alternated in one process (an AMX host only); writes bench/results/tiles.json and .png.

With --model DIR (a model of another family, e.g. bench/bench_families.py's of the default model's size):
the engine on DIR against the engine on the default model (Llama) in the same run, instead of
transformers: each one's tok/s and their ratio.
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


def engine_side(args, prompts, model: str = "default", label: str = "loraplex"):
    """The engine on `model`, loaded and warmed up -> (llm, run): run() times one generate of the workload
    (tok/s)."""
    from engine.llm import LLM
    from ipc.sampling_params import SamplingParams
    llm = LLM(model=model, dtype=args.dtype, max_num_seqs=args.num, max_num_batched_tokens=args.max_batched_tokens,
              enable_prefix_caching=False, device=args.device, backend=args.backend)
    params = SamplingParams(temperature=0, max_tokens=args.out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))   # warm-up

    def run() -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        n = sum(len(o.token_ids) for o in outs)
        assert n == args.num * args.out_len
        print(f"{label:13s}: {n} tokens in {dt:7.2f} s = {n / dt:8.1f} tok/s")
        return n / dt
    return llm, run


def compare_models(args, prompts, models: dict[str, str]) -> dict[str, list[float]]:
    """The engine on each model (label -> 'default' or a directory), every one loaded first, then their
    runs alternated `args.repeats` times -> label -> tok/s of each run. Each engine's decoder kind is
    printed (the C decoder, or op by op), since a family that left the fast path would show here."""
    runs = {}
    for label, model in models.items():
        llm, runs[label] = engine_side(args, prompts, model, label)
        m = llm.engine.runner.model
        fused = m.decoder(llm.engine.runner.kv_caches) is not None
        print(f"  {label}: {m.cfg.family}, backend {llm.engine.runner.backend.name}, "
              f"{'the one-call C decoder' if fused else 'layers op by op'}")
    results = {label: [] for label in runs}
    for _ in range(args.repeats):
        for label, run in runs.items():
            results[label].append(run())
    return results


def family_vs_llama(args, prompts) -> None:
    results = compare_models(args, prompts, {"llama": "default", "family": args.model})
    fam, llama = max(results["family"]), max(results["llama"])
    print(f"ratio        : {fam / llama:.2f}x Llama ({fam:.1f} vs {llama:.1f} tok/s, the best of each; "
          f"{args.model})")


def amx_vs_vdpbf16ps(args, prompts) -> None:
    """One engine, its GEMM tiles switched between AMX and vdpbf16ps run by run (kernels/cpu/gemm.amx)."""
    from bench.output import write
    from kernels.cpu import gemm
    if not gemm.amx():
        raise SystemExit("no AMX tiles on this host (an Intel CPU with AMX-BF16 and Linux >= 5.16 runs them)")
    llm, run = engine_side(args, prompts)
    results = {"amx": [], "vdpbf16ps": []}
    try:
        for _ in range(args.repeats):
            for kind in results:
                gemm.amx(kind == "amx")
                print(f"  tiles: {kind}")
                results[kind].append(run())
    finally:
        gemm.amx(True)
    amx, vnni = max(results["amx"]), max(results["vdpbf16ps"])
    print(f"ratio        : {amx / vnni:.2f}x with AMX tiles ({amx:.1f} vs {vnni:.1f} tok/s, the best of each)")

    def plot(ax):
        ax.bar(list(results), [amx, vnni])
        ax.set_ylabel("output tokens / s (best run)")
        ax.set_title(f"bench_engine --tiles: {args.num} x ({args.prompt_len} + {args.out_len}) tokens, {args.dtype}")
    write("tiles", {"args": vars(args), "tok_s": results, "ratio": amx / vnni}, plot)


def llm_device(args) -> torch.device:
    from kernels.selector import resolve_device
    return resolve_device(args.device)


def hf_side(args, prompts):
    """transformers' batched generate on the same weights and dtype -> run() as engine_side's."""
    from transformers import AutoModelForCausalLM

    from engine.model.resolve import resolve_model
    path, _ = resolve_model("default")
    dtype = getattr(torch, args.dtype)
    device = llm_device(args)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=4, **{**kw, "attention_mask": torch.ones_like(ids[:2])})

    def run() -> float:
        with torch.no_grad():
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.out_len, min_new_tokens=args.out_len, **kw)
            dt = time.perf_counter() - t
        n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        print(f"transformers : {n} tokens in {dt:7.2f} s = {n / dt:8.1f} tok/s")
        return n / dt
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out-len", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each side, alternated; the best of each is compared (this machine's speed "
                        "drifts within minutes)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (both sides)")
    p.add_argument("--backend", default="auto", help="the engine's compute backend")
    p.add_argument("--tiles", action="store_true", help="AMX tiles against vdpbf16ps tiles (an AMX host)")
    p.add_argument("--model", default=None, help="a model directory of another family: compared with the "
                                                   "default model (Llama) instead of transformers")
    args = p.parse_args()
    prompts = make_prompts(args.num, args.prompt_len, 49152)
    print(f"{args.num} requests x ({args.prompt_len} prompt + {args.out_len} new tokens), {args.dtype}, "
          f"{torch.get_num_threads()} threads, best of {args.repeats} alternated runs")
    if args.model:
        return family_vs_llama(args, prompts)
    if args.tiles:
        return amx_vs_vdpbf16ps(args, prompts)
    llm, ours_run = engine_side(args, prompts)
    theirs_run = None if args.skip_hf else hf_side(args, prompts)
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(ours_run())
        if theirs_run is not None:
            theirs.append(theirs_run())
    n = args.num * args.out_len
    print(f"  device {llm.engine.runner.device}, backend {llm.engine.runner.backend.name}")
    if llm.engine.runner.device.type != "cpu":
        if theirs:
            print(f"ratio        : {max(ours) / max(theirs):.2f}x transformers ({max(ours):.1f} vs {max(theirs):.1f} "
                  "tok/s, the best of each)")
        return
    bound = gemm_bound(args, llm.engine.runner.model.w)
    print(f"  the base GEMMs alone take ~{bound:.2f} s (timed separately): a run of nothing but GEMMs would "
          f"give {n / bound:.1f} tok/s")
    kv_s, kv_bytes, bw = kv_read_bound(args, llm)
    print(f"  decode attention must read {kv_bytes / 1e9:.1f} GB of K/V: {kv_s:.2f} s at this machine's "
          f"{bw / 1e9:.1f} GB/s (a plain read of the KV pool); GEMMs + K/V reads: {n / (bound + kv_s):.1f} tok/s")
    if theirs:
        best, hf = max(ours), max(theirs)
        print(f"ratio        : {best / hf:.2f}x transformers ({best:.1f} vs {hf:.1f} tok/s, the best of each; "
              f"bounds: GEMMs alone {n / bound / hf:.2f}x, GEMMs + K/V reads {n / (bound + kv_s) / hf:.2f}x)")
        pairs = [o / t for o, t in zip(ours, theirs)]          # each engine run against the run after it
        print(f"  each pair of runs: {', '.join(f'{r:.2f}x' for r in pairs)}")


if __name__ == "__main__":
    main()
