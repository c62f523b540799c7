"""The C API has one declaration (csrc/loraplex_kernels.h, which every .c file includes, so the compiler holds
each definition to it) and the ctypes signatures in kernels/cpu/c_api.py agree with it, function by function;
each library built here exports what c_api says it does."""
from __future__ import annotations

import ctypes
import re

import pytest

from kernels.cpu import build, c_api

HEADER = build.SOURCES / "loraplex_kernels.h"
CTYPE = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "void": None}


def declared() -> dict[str, tuple]:
    """name -> (return ctype, [argument ctypes]) of every function the header declares."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    out = {}
    for ret, name, params in re.findall(r"^(\w+)\s+(\w+)\((.*?)\);", text, flags=re.M | re.S):
        args = []
        for param in (p.strip() for p in params.split(",")):
            words = param.replace("*", " * ").split()
            args.append(ctypes.c_void_p if "*" in words else CTYPE[words[-2]])
        out[name] = (CTYPE[ret], args)
    return out


def test_the_ctypes_signatures_are_the_headers():
    decl = declared()
    table = {fn: sig for lib in c_api.LIBRARIES.values() for fn, sig in lib.items()}
    assert len(decl) == 29 and set(decl) == set(table), set(decl) ^ set(table)
    for fn, (ret, args) in table.items():
        assert decl[fn] == (ret, list(args)), fn


def test_every_source_includes_the_header_and_every_library_has_its_source():
    for src in build.SOURCES.glob("*.c"):
        assert '#include "loraplex_kernels.h"' in src.read_text(), src.name
    assert {p.stem for p in build.SOURCES.glob("*.c")} == set(c_api.LIBRARIES)


@pytest.mark.parametrize("library", sorted(c_api.LIBRARIES))
def test_each_library_exports_its_functions(library):
    try:
        lib = build.build(library)
    except RuntimeError as e:
        pytest.skip(f"{library} does not build here: {e}")
    for fn in c_api.LIBRARIES[library]:
        assert hasattr(lib, fn), fn


def test_a_signature_that_disagrees_is_caught(monkeypatch):
    """The check itself: one argument type changed in the table is found."""
    broken = dict(c_api.LIBRARIES, gemm_avx2={"gemm_bf16_avx2": (ctypes.c_int, [ctypes.c_void_p] * 8)})
    monkeypatch.setattr(c_api, "LIBRARIES", broken)
    with pytest.raises(AssertionError, match="gemm_bf16_avx2"):
        test_the_ctypes_signatures_are_the_headers()
