"""Imports flow one way: ipc <- kernels <- engine <- frontends. Every module's imports are parsed (top level
and inside functions); an arrow that runs back fails, naming the module and the line."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["ipc", "kernels", "engine", "frontends"]          # each may import only those before it
BACKENDS = ("kernels.reference", "kernels.cpu", "kernels.triton")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
    return out


def modules(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


def violations(path: Path, allowed: set[str], forbidden_prefixes: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for line, mod in imports(path):
        top = mod.split(".")[0]
        if top in LAYERS and top not in allowed:
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
        elif mod.startswith(forbidden_prefixes):
            bad.append(f"{path.relative_to(ROOT)}:{line} imports backend module {mod}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_flow_one_way(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    bad = [v for p in modules(layer) for v in violations(p, allowed)]
    assert not bad, "imports that run back:\n" + "\n".join(bad)


def test_engine_imports_only_the_backend_interface():
    bad = [v for p in modules("engine") for v in violations(p, {"ipc", "kernels", "engine"}, BACKENDS)]
    assert not bad, "engine/ must reach backends through kernels.backend and kernels.selector:\n" + "\n".join(bad)


def test_the_checker_sees_a_backward_import(tmp_path):
    """The check itself: a module of ipc importing engine, or engine importing kernels.cpu, is caught."""
    (tmp_path / "ipc").mkdir()
    bad = tmp_path / "ipc" / "bad.py"
    bad.write_text("import os\n\ndef f():\n    from engine.config import EngineConfig\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert violations(bad, {"ipc"}) == ["ipc/bad.py:4 imports engine.config"]
        bad.write_text("from kernels.cpu.gemm import Gemm\n")
        assert violations(bad, {"ipc", "kernels"}, BACKENDS) == ["ipc/bad.py:1 imports backend module kernels.cpu.gemm"]
    finally:
        ROOT = old
