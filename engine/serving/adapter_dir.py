"""An adapter directory: every sub-folder holding a PEFT adapter, known under the folder's name; and
adapters on demand, a requested name mapped to `DIR/<name>`, safely.

The server lists the folder at start-up and reads nothing in it (`AdapterCatalog`): an adapter's files are
first opened when a request or a load names it, so the time to ready does not depend on how many adapters
the folder holds or how large they are."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from engine.lora.host_adapter import files_signature
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


def list_adapter_dir(adapter_dir: str) -> list[str]:
    """The sub-folders holding adapter_config.json whose names are valid adapter names, sorted. One
    directory listing and one stat per sub-folder: no file is opened."""
    if not Path(adapter_dir).is_dir():
        raise ValueError(f"--adapter-dir: {adapter_dir} is not a directory")
    names = []
    with os.scandir(adapter_dir) as it:
        for entry in it:
            try:
                check_adapter_name(entry.name)
            except ValueError:
                continue
            if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "adapter_config.json")):
                names.append(entry.name)
    return sorted(names)


class AdapterCatalog:
    """--adapter-dir as the server knows it without reading it: the names listed at start-up, and the
    folders refused at first use with the reason, remembered until the folder's files change."""

    def __init__(self, adapter_dir: str):
        self.root = adapter_dir
        self.listed = set(list_adapter_dir(adapter_dir))
        self.refused: dict[str, tuple[tuple[int, ...], str]] = {}   # name -> (files' signature, why)

    def names(self) -> set[str]:
        """Listed and not (currently) refused: what /v1/models shows besides the registered adapters."""
        return self.listed - set(self.refused)

    def refusal(self, name: str) -> str | None:
        """Why DIR/<name> was refused, if it was and has not changed since."""
        entry = self.refused.get(name)
        if entry is None:
            return None
        if entry[0] != files_signature(Path(self.root) / name):
            del self.refused[name]          # changed: try it again
            return None
        return entry[1]

    def refuse(self, name: str, why: str) -> None:
        self.refused[name] = (files_signature(Path(self.root) / name), why)

    def forget_refusal(self, name: str) -> None:
        self.refused.pop(name, None)


def register_adapter_dir(engine, adapter_dir: str) -> tuple[list[str], dict[str, str]]:
    """Register every subfolder of `adapter_dir` holding adapter_config.json, under its folder name (the
    offline command line; the server lists the folder instead, AdapterCatalog). A subfolder that fails
    validation (bad name, config or weight shapes) is logged and skipped: the others serve.
    engine: anything with register_adapter(name, path) (EngineCore).
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
