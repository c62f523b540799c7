"""DoRA adapters (engine/lora/dora.py) against plain LoRA adapters of the same weights, in one run: default
model, bfloat16, `LLM()` at its defaults.

64 requests x (64 prompt + 64 new tokens) over 16 rank-8 adapters on all seven projections: (lora) the
adapters as plain LoRA; (dora) the same A and B with DoRA magnitudes (each row's ||W + s B A|| times
1 + 5% noise, as a trained adapter's). Each side runs once to load its adapters, then the two alternate,
best of `--repeats` each; the ratio dora / lora is printed, and the time from a request for a cold adapter
to its first token, DoRA against LoRA (the loader computes DoRA's row scales from the base weights once, at
load; the first DoRA adapter also computes the base rows' norms, kept for the next ones).
Writes bench/results/dora.json and .png. Usage: python -m bench.bench_dora [--repeats 2]
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.adapters import ALL, write_peft_adapter
from bench.bench_lora import alternate, pair_args, prompts_for, run
from bench.output import write_pair
from engine.config import EngineConfig
from engine.llm import LLM
from engine.lora.dora import BaseRows, row_norms
from engine.lora.host_adapter import load_host_adapter
from engine.lora.peft_config import module_path

NUM, ADAPTERS, RANK = 64, 16, 8


def as_dora(src: Path, dst: Path, llm: LLM, seed: int, max_rank: int = 64) -> Path:
    """src's adapter with DoRA magnitudes over the engine's base weights (tests use it too)."""
    if (dst / "adapter_config.json").is_file():
        return dst
    shutil.copytree(src, dst)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    tensors = load_file(src / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    host = load_host_adapter(src, llm.config.model, max_rank)
    base = BaseRows(llm.engine.runner.base_weight)
    for (layer, module), m in host.modules.items():
        norms = row_norms(base, layer, module, m.a, m.b, m.scale)
        noise = 1 + 0.05 * torch.randn(norms.shape, generator=g)
        tensors[f"base_model.model.{module_path(layer, module)}.lora_magnitude_vector"] = norms * noise
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def load_time(llm: LLM, name: str, prompt) -> float:
    """Seconds from a request for a registered, never loaded adapter to its first token."""
    t = time.perf_counter()
    run(llm, [prompt], [name], 1)
    return time.perf_counter() - t


def main() -> None:
    args, work = pair_args(__doc__, "bench-dora-")
    cfg = EngineConfig.create(dtype="bfloat16").model
    llm = LLM(dtype="bfloat16")
    lora = [f"l{i}" for i in range(ADAPTERS)]
    dora = [f"d{i}" for i in range(ADAPTERS)]
    for i in range(ADAPTERS):
        src = write_peft_adapter(work / lora[i], cfg, RANK, ALL, seed=i)
        llm.register_adapter(lora[i], str(src))
        llm.register_adapter(dora[i], str(as_dora(src, work / dora[i], llm, seed=i)))
    prompts = prompts_for(NUM, args.prompt_len)
    run(llm, prompts[:1], [None], 2)              # the engine's first steps, before any timing
    loads = {"lora": load_time(llm, lora[0], prompts[0]), "first_dora": load_time(llm, dora[0], prompts[0]),
             "dora": load_time(llm, dora[1], prompts[0])}
    loras, doras = alternate(llm, prompts, [lora[i % ADAPTERS] for i in range(NUM)],
                             [dora[i % ADAPTERS] for i in range(NUM)], args.out_len, args.repeats)
    print(f"{NUM} requests x {args.prompt_len}+{args.out_len} tokens over {ADAPTERS} rank-{RANK} adapters on all "
          f"projections, bfloat16, LLM() defaults; best of {args.repeats} alternated runs")
    print(f"    first token of a cold adapter: LoRA {loads['lora'] * 1e3:.0f} ms, DoRA {loads['dora'] * 1e3:.0f} ms "
          f"(the first DoRA adapter {loads['first_dora'] * 1e3:.0f} ms: it also reads the base rows' norms)")
    write_pair("dora", ("LoRA adapters", loras), ("the same as DoRA", doras),
               f"{NUM} requests, {ADAPTERS} rank-{RANK} adapters, bf16",
               {"requests": NUM, "adapters": ADAPTERS, "rank": RANK, "cold_first_token_s": loads})
    llm.close()


if __name__ == "__main__":
    main()
