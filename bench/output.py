"""Where a benchmark's figures go: a JSON file of what it measured and a PNG plot beside it (matplotlib,
headless), both under bench/results/ unless --out says otherwise."""
from __future__ import annotations

import json
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def host() -> str:
    """The CPU model (with family / model: a VM may name only the vendor), its widest bf16 instructions and
    the core count, as figures must name them."""
    import os
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags", "").split()
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, {isa}), " \
           f"{os.cpu_count()} cores"


def write(name: str, data: dict, plot, out: str | None = None) -> tuple[Path, Path]:
    """data -> OUT/NAME.json (with the host); plot(ax) draws on a fresh figure -> OUT/NAME.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = Path(out) if out else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    js, png = d / f"{name}.json", d / f"{name}.png"
    js.write_text(json.dumps({"host": host(), **data}, indent=1))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    plot(ax)
    ax.set_title(f"{ax.get_title()}\n{host()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {js} and {png}")
    return js, png


def write_pair(name: str, base: tuple[str, list[float]], other: tuple[str, list[float]], title: str, data: dict,
               goal: str = "") -> float:
    """Two sides of one run as tokens/s per alternated run (label, runs): prints each side's best and runs and
    the ratio best other / best base (with `goal`, e.g. "goal >= 0.7x"), writes NAME.json (data, both sides'
    runs, the ratio) and a bar plot of the best runs titled `title` -> the ratio."""
    (label_a, runs_a), (label_b, runs_b) = base, other
    best_a, best_b = max(runs_a), max(runs_b)
    ratio = best_b / best_a
    for label, best, runs in ((label_a, best_a, runs_a), (label_b, best_b, runs_b)):
        print(f"    {label:<22}: {best:8.1f} tok/s   (runs: {', '.join(f'{x:.0f}' for x in runs)})")
    print(f"    {'ratio':<22}: {ratio:.2f}x {label_a}" + (f" ({goal})" if goal else ""))

    def plot(ax):
        ax.bar([label_a, label_b], [best_a, best_b], color=["#4c72b0", "#dd8452"])
        ax.set_ylabel("tokens / s (best run)")
        ax.set_title(f"{name}: {ratio:.2f}x ({title})")
    write(name, {**data, "base": {"label": label_a, "tok_s": runs_a}, "other": {"label": label_b, "tok_s": runs_b},
                 "ratio": ratio}, plot)
    return ratio
