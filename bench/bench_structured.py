"""Structured outputs against free generation, in one run: default model, bfloat16, `LLM()` at its defaults.

64 requests x (64 prompt + 64 new tokens), greedy: (free) no constraint, ignore_eos; (constrained) every
request under the EBNF grammar `root ::= [a-z ,.] root` (xgrammar; it never ends, so both sides make 64
tokens a request, and its matcher's state stays small: the cost measured is the engine's, per step). The
sides alternate, best of `--repeats` each; the ratio constrained / free is printed (goal >= 0.9x). Beside
it, one step's mask for the 64 rows as the engine makes it (`constrain`: the bitmask filled by xgrammar,
a copy of the logits, the backend's `mask_logits_`, the C kernel on CPU) against a copy plus xgrammar's
own `apply_token_bitmask_inplace` (the bitmask already filled), best of 20 each.
Writes bench/results/structured.json and .png. Usage: python -m bench.bench_structured [--repeats 2]
"""
from __future__ import annotations

import time

import torch

from bench.bench_lora import pair_args, prompts_for
from bench.output import write_pair
from engine.llm import LLM
from engine.structured_output import constrain
from ipc.sampling_params import SamplingParams, StructuredOutputsParams

NUM = 64
GRAMMAR = 'root ::= [a-z ,.] root'


def run(llm: LLM, prompts, constrained: bool, out_len: int) -> float:
    spec = StructuredOutputsParams(grammar=GRAMMAR) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=not constrained, structured_outputs=spec)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(prompts) * out_len, n
    return n / dt


def mask_ms(llm: LLM) -> tuple[float, float]:
    """One step's mask over NUM rows: the backend's and xgrammar's, ms (best of 20)."""
    import xgrammar as xgr
    g = llm.engine.grammars
    matchers = [g.matcher(StructuredOutputsParams(grammar=GRAMMAR)) for _ in range(NUM)]
    logits = torch.randn(NUM, llm.engine.cfg.model.vocab_size, dtype=torch.bfloat16)
    mask = xgr.allocate_token_bitmask(NUM, logits.shape[1])
    for i, m in enumerate(matchers):
        m.m.fill_next_token_bitmask(mask, i)

    def best(fn) -> float:
        times = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times) * 1e3
    ours = best(lambda: constrain(logits, matchers, llm.engine.runner.backend.mask_logits_))
    theirs = best(lambda: xgr.apply_token_bitmask_inplace(logits.float(), mask, vocab_size=logits.shape[1]))
    return ours, theirs


def main() -> None:
    args, _ = pair_args(__doc__, "bench-structured-")
    llm = LLM(dtype="bfloat16")
    prompts = prompts_for(NUM, args.prompt_len)
    run(llm, prompts, False, 2)
    run(llm, prompts, True, 2)
    free, constrained = [], []
    for _ in range(args.repeats):
        free.append(run(llm, prompts, False, args.out_len))
        constrained.append(run(llm, prompts, True, args.out_len))
    ours, theirs = mask_ms(llm)
    print(f"{NUM} requests x {args.prompt_len}+{args.out_len} tokens, greedy, bfloat16, LLM() defaults; "
          f"best of {args.repeats} alternated runs")
    print(f"    one step's mask, {NUM} rows: {ours:.2f} ms (fill + copy + backend mask) vs {theirs:.2f} ms "
          f"(fp32 copy + xgrammar's apply) = {theirs / ours:.1f}x")
    write_pair("structured", ("free", free), ("grammar [a-z ,.]...", constrained), f"{NUM} requests, bf16",
               {"requests": NUM, "grammar": GRAMMAR, "mask_ms": {"backend": ours, "xgrammar": theirs}},
               goal="goal >= 0.9x")
    llm.close()


if __name__ == "__main__":
    main()
