"""Does start-up depend on how many adapters --adapter-dir holds? Time from `loraplex serve` to its ready line
with an empty --adapter-dir and with one holding --num adapters (rank-16 adapters on all seven projections,
float32 files; hard links to one file, which loraplex does not read at start-up either way), alternated
--repeats times, in one run; prints the medians and their ratio (goal <= 1.2x); writes
bench/results/startup.json and .png.
Usage: python -m bench.bench_startup [--num 1000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.adapters import ALL, write_peft_adapter
from bench.output import write
from bench.serving import start_timed, stop_server


def fill(d: Path, src: Path, n: int) -> None:
    for i in range(n):
        dst = d / f"tenant{i:05d}"
        if not dst.exists():
            dst.mkdir(parents=True)
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                os.link(src / f, dst / f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    from engine.config import EngineConfig
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "loraplex-bench-startup")
    src = write_peft_adapter(work / "source", EngineConfig.create().model, 16, ALL, seed=1, dtype=torch.float32)
    empty, full = work / "empty", work / "full"
    empty.mkdir(parents=True, exist_ok=True)
    fill(full, src, args.num)
    times = {"none": [], f"{args.num} adapters": []}
    for _ in range(args.repeats):
        for label, d in zip(times, (empty, full)):
            proc, _, ready = start_timed(["--adapter-dir", str(d)])
            stop_server(proc)
            times[label].append(ready)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med[f"{args.num} adapters"] / med["none"]
    mb = src.joinpath("adapter_model.safetensors").stat().st_size / 1e6
    for k, v in times.items():
        print(f"ready with {k:>14s} in --adapter-dir: median {med[k]:.2f} s ({', '.join(f'{t:.2f}' for t in v)})")
    print(f"ratio {ratio:.2f}x (goal <= 1.2x); adapters of {mb:.0f} MB each")

    def plot(ax):
        for i, (k, v) in enumerate(times.items()):
            ax.scatter([i] * len(v), v, label=f"{k}: median {med[k]:.2f} s")
        ax.set_xticks(range(len(times)), list(times))
        ax.set_ylabel("seconds to the ready line")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.set_title(f"bench_startup: {ratio:.2f}x with {args.num} adapters in --adapter-dir")
    write("startup", {"args": vars(args), "seconds": times, "ratio": ratio}, plot)


if __name__ == "__main__":
    main()
