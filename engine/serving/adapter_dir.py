"""An adapter directory: every sub-folder holding a PEFT adapter, registered under the folder's name; and
adapters on demand, a requested name mapped to `DIR/<name>`, safely."""
from __future__ import annotations

from pathlib import Path

from ipc.adapter_names import check_adapter_name


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


def register_adapter_dir(engine, adapter_dir: str) -> list[str]:
    """Register every subfolder of `adapter_dir` holding adapter_config.json, under its folder name.
    engine: anything with register_adapter(name, path) (EngineCore)."""
    root = Path(adapter_dir)
    if not root.is_dir():
        raise ValueError(f"--adapter-dir: {adapter_dir} is not a directory")
    names = []
    for sub in sorted(root.iterdir()):
        if (sub / "adapter_config.json").is_file():
            engine.register_adapter(sub.name, str(sub))
            names.append(sub.name)
    return names
