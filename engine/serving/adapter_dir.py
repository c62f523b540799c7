"""Adapters on demand: map a requested adapter name to `DIR/<name>`, safely."""
from __future__ import annotations

import re
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def resolve_adapter_dir(adapter_dir: str, name: str) -> Path:
    """Return DIR/<name> for a valid name whose real path stays inside DIR; LookupError otherwise.

    Names are letters, digits, '.', '_' and '-', starting with a letter or digit (so no path separators
    and no '..'); a symlink leading out of DIR is refused."""
    if not _NAME.match(name) or ".." in name:
        raise ValueError(f"adapter name {name!r} is invalid: use letters, digits, '.', '_' and '-'")
    root = Path(adapter_dir).resolve()
    path = (root / name).resolve()
    if root not in path.parents:
        raise ValueError(f"adapter {name!r} leads outside the adapter directory")
    if not (path / "adapter_config.json").is_file():
        raise LookupError(f"adapter {name!r} is not registered and {adapter_dir}/{name} holds no PEFT adapter")
    return path
