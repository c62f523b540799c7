"""How fast is a cold adapter load? For each of N adapters of ranks 8 / 16 / 32 on all seven projections
(float32 files, as PEFT saves them), three things on the same files, in one run:
- memcpy: one copy of the adapter file's bytes, already in memory, into a buffer already touched (the
  copy limit of this host);
- loraplex: a cold load as the engine does it for a request naming an adapter not registered yet (its
  files in the page cache): register (config and header) + load (read, convert, pack, write its pages),
  until its pages are ready, through the engine's own loader thread (the start-up's objects frozen out of
  the garbage collector, as in the server's engine process);
- PEFT: `PeftModel.load_adapter` of the same folder into the base model.
Prints the medians and both ratios (goals: loraplex <= 3x memcpy, >= 100x faster than PEFT); writes
bench/results/coldstart.json and .png (per-adapter times against file size).
Usage: python -m bench.bench_coldstart [--num 64] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.adapters import ALL, write_peft_adapter
from bench.output import write


def memcpy_seconds(path: Path, repeats: int = 3) -> float:
    data = path.read_bytes()
    dst = bytearray(len(data))
    dst[:] = data                         # touched once: no page faults in the timed copies
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst[:] = data
        best = min(best, time.perf_counter() - t)
    return best


def loraplex_seconds(llm, name: str, path: Path) -> float:
    core = llm.engine
    path.joinpath("adapter_model.safetensors").read_bytes()     # in the page cache, as the goal says
    t = time.perf_counter()
    core.register_adapter(name, str(path))
    core.prefetch_adapter(name)
    core.adapters.wait_loads()
    assert core.adapters.lookup(name).state.value == "resident"
    dt = time.perf_counter() - t
    core.unregister_adapter(name)                                 # frees its pages and host copy
    return dt


def peft_seconds(model, name: str, path: Path) -> float:
    t = time.perf_counter()
    model.load_adapter(str(path), adapter_name=name)
    dt = time.perf_counter() - t
    model.delete_adapter(name)
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (make gpu-check): the pool and PEFT's model there; "
                   "on cuda a cold load ends when its pages' copy on the side stream has landed")
    p.add_argument("--backend", default=None, help="the engine's backend (default: this host's best); torch packs "
                   "as a GPU load does (row-major, into a staging buffer), without the copy")
    p.add_argument("--peft-every", type=int, default=4, help="time PEFT on every k-th adapter (it is slow)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.core.engine_core import freeze_startup_objects
    from engine.llm import LLM
    from engine.model.resolve import resolve_model
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-coldstart")
    cfg = EngineConfig.create(dtype=args.dtype).model
    dirs = [write_peft_adapter(work / f"c{i}", cfg, (8, 16, 32)[i % 3], ALL, seed=40_000 + i, dtype=torch.float32)
            for i in range(args.num)]
    sizes = [d.joinpath("adapter_model.safetensors").stat().st_size for d in dirs]
    copy = [memcpy_seconds(d / "adapter_model.safetensors") for d in dirs]
    llm = LLM(dtype=args.dtype, device=args.device, **({"backend": args.backend} if args.backend else {}))
    freeze_startup_objects()        # as the server's engine process does once it is built
    loraplex_seconds(llm, "warm-up", dirs[0])
    ours = [loraplex_seconds(llm, f"c{i}", d) for i, d in enumerate(dirs)]
    llm.close()
    del llm
    path, _ = resolve_model("default")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval().to(args.device)
    model = PeftModel.from_pretrained(base, str(dirs[0]), adapter_name="first")
    picked = list(range(0, args.num, args.peft_every))
    theirs = {i: peft_seconds(model, f"p{i}", dirs[i]) for i in picked}
    ratio_copy = statistics.median(o / c for o, c in zip(ours, copy))
    ratio_peft = statistics.median(theirs[i] / ours[i] for i in picked)
    mb = [s / 1e6 for s in sizes]
    print(f"{args.num} adapters, ranks 8/16/32 on all seven projections, float32 files of {min(mb):.0f}-{max(mb):.0f} "
          f"MB, model dtype {args.dtype}")
    print(f"median memcpy of the file's bytes : {1e3 * statistics.median(copy):7.1f} ms")
    print(f"median loraplex cold load         : {1e3 * statistics.median(ours):7.1f} ms")
    print(f"median PEFT load_adapter          : {1e3 * statistics.median(theirs.values()):7.1f} ms "
          f"({len(picked)} of them)")
    print(f"loraplex / memcpy: {ratio_copy:.2f}x (goal <= 3x: {'met' if ratio_copy <= 3 else 'not met'}); "
          f"PEFT / loraplex: {ratio_peft:.1f}x (goal >= 100x: {'met' if ratio_peft >= 100 else 'not met'})")

    def plot(ax):
        ax.scatter(mb, [1e3 * t for t in copy], s=10, label="memcpy of the file's bytes")
        ax.scatter(mb, [1e3 * t for t in ours], s=10, label="loraplex cold load (register + pages ready)")
        ax.scatter([mb[i] for i in picked], [1e3 * theirs[i] for i in picked], s=10, label="PEFT load_adapter")
        ax.set_yscale("log")
        ax.set_xlabel("adapter file (MB, float32)")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.set_title(f"bench_coldstart: loraplex {ratio_copy:.2f}x memcpy, PEFT {ratio_peft:.0f}x loraplex")
    write("coldstart", {"args": vars(args), "file_bytes": sizes, "memcpy_s": copy, "loraplex_s": ours,
                        "peft_s": {str(i): t for i, t in theirs.items()}, "loraplex_over_memcpy": ratio_copy,
                        "peft_over_loraplex": ratio_peft}, plot, args.out)


if __name__ == "__main__":
    main()
