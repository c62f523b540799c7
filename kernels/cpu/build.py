"""Compile a C source of this package once per machine and load it with ctypes.

The shared object is cached under `<SETTINGS.cache_dir>/kernels/`, keyed by the source, the compiler flags
and this CPU's feature flags (it is built with -march=native). Building writes a temporary file and
renames it into place, so concurrent processes never load a half-written library. Load it after
`import torch`: the library's OpenMP calls then bind to the runtime torch already loaded, so both
share one thread pool.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels.cpu import c_api

log = logging.getLogger("loraplex.kernels")

@dataclass
class BuildSettings:
    """Where compiled kernels are cached and whether the C kernels are used at all. The engine sets them
    from its environment (`configure`, called by kernels.selector); the defaults serve direct users."""
    cache_dir: str = str(Path.home() / ".cache" / "loraplex")
    enabled: bool = True


SETTINGS = BuildSettings()


def configure(cache_dir: str | None = None, enabled: bool | None = None) -> None:
    """Set the build settings (None keeps one). Call before the first kernel is loaded: a library
    already loaded, or found missing, stays so for this process."""
    if cache_dir is not None:
        SETTINGS.cache_dir = cache_dir
    if enabled is not None:
        SETTINGS.enabled = enabled


SOURCES = Path(__file__).with_name("csrc")   # the C sources, and loraplex_kernels.h: the exported C API
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: linking with it adds crtfastmath.o, whose constructor turns on flush-to-zero
# and denormals-are-zero for the whole process that loads the library (every user's float code with it).
LINK_FLAGS = ["-shared", "-fopenmp"]


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def has_avx512_bf16() -> bool:
    """Whether this CPU has vdpbf16ps (the kernels that need it are not built otherwise)."""
    return "avx512_bf16" in _cpu_flags()


def has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles with bf16 (Intel Sapphire Rapids and later)."""
    flags = _cpu_flags().split()
    return "amx_tile" in flags and "amx_bf16" in flags


def has_avx2_fma() -> bool:
    """Whether this CPU has AVX2 and FMA (the fp32-compute kernels for bf16 data need both)."""
    flags = _cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def build(name: str) -> ctypes.CDLL:
    """Build (if needed) and load `csrc/<name>.c`. Raises RuntimeError when it cannot."""
    src = SOURCES / f"{name}.c"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    # a unity build (decoder.c) includes other .c files: they are part of its key too
    included = re.findall(r'^#include "(\w+\.c)"', src.read_text(), flags=re.M)
    sources = [src, *(src.parent / c for c in included), *sorted(src.parent.glob("*.h"))]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(FLAGS + LINK_FLAGS).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    out = Path(SETTINGS.cache_dir) / "kernels" / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        steps = ([cc, *FLAGS, f"-I{src.parent}", "-c", str(src), "-o", obj], [cc, *LINK_FLAGS, obj, "-o", tmp, "-lm"])
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True)
            if proc.returncode != 0:
                for f in (tmp, obj):
                    if os.path.exists(f):
                        os.unlink(f)
                raise RuntimeError(f"compiling {src.name} failed: {proc.stderr.strip()[:2000]}")
        os.unlink(obj)
        os.replace(tmp, out)
        log.info("built %s", out)
    return ctypes.CDLL(str(out))


def load_functions(name: str, symbols: dict) -> dict | None:
    """{key: C function} for `symbols` ({key: symbol name}) of library `name` (csrc/<name>.c), with the
    ctypes signatures of c_api.LIBRARIES set; None when the C kernels are disabled (SETTINGS.enabled) or
    cannot be built here."""
    if not SETTINGS.enabled:
        return None
    try:
        lib = build(name)
    except (RuntimeError, OSError) as e:
        log.warning("C kernel %s unavailable, using the torch path: %s", name, e)
        return None
    fns = {}
    for key, sym in symbols.items():
        fn = getattr(lib, sym)
        fn.restype, fn.argtypes = c_api.LIBRARIES[name][sym]
        fns[key] = fn
    return fns
