"""An adapter directory: every sub-folder holding a PEFT adapter, registered under the folder's name; and
adapters on demand, a requested name mapped to `DIR/<name>`, safely."""
from __future__ import annotations

import logging
from pathlib import Path

from ipc.adapter_names import check_adapter_name

log = logging.getLogger("loraplex.adapters")


def resolve_adapter_dir(adapter_dir: str, name: str) -> Path:
    """Return DIR/<name> for a valid name (ipc.adapter_names) whose real path stays inside DIR: ValueError
    for an invalid name or a symlink leading out of DIR, LookupError when no adapter is there."""
    check_adapter_name(name)
    root = Path(adapter_dir).resolve()
    path = (root / name).resolve()
    if root not in path.parents:
        raise ValueError(f"adapter {name!r} leads outside the adapter directory")
    if not (path / "adapter_config.json").is_file():
        raise LookupError(f"adapter {name!r} is not registered and {adapter_dir}/{name} holds no PEFT adapter")
    return path


def register_adapter_dir(engine, adapter_dir: str) -> tuple[list[str], dict[str, str]]:
    """Register every subfolder of `adapter_dir` holding adapter_config.json, under its folder name.
    A subfolder that fails validation (bad name, config or weights) is logged and skipped: the others
    serve. engine: anything with register_adapter(name, path) (EngineCore).
    -> (the names registered, {refused name: why})."""
    root = Path(adapter_dir)
    if not root.is_dir():
        raise ValueError(f"--adapter-dir: {adapter_dir} is not a directory")
    names, refused = [], {}
    for sub in sorted(root.iterdir()):
        if (sub / "adapter_config.json").is_file():
            try:
                engine.register_adapter(sub.name, str(sub))
            except (ValueError, LookupError, OSError) as e:
                refused[sub.name] = str(e.args[0]) if e.args else str(e)
                log.warning("adapter %s refused, skipped: %s", sub, refused[sub.name])
                continue
            names.append(sub.name)
    return names, refused


def check_load_path(path: str, roots: list[str]) -> str:
    """The real path of a runtime `lora_path`, which must lie inside one of `roots` (--adapter-dir and
    --lora-roots): ValueError naming the rule otherwise."""
    real = Path(path).resolve()
    allowed = [Path(r).resolve() for r in roots]
    if not any(real == r or r in real.parents for r in allowed):
        where = ", ".join(str(r) for r in allowed) or "none configured"
        raise ValueError(f"lora_path {path!r} is outside the folders adapters may be loaded from "
                         f"(--adapter-dir and --lora-roots: {where})")
    return str(real)
