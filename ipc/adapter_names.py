"""The one rule for adapter names, shared by every process (frontends check early, the engine again).

A name is 1-128 characters: letters, digits, '.', '_', '-' and ':', starting with a letter or digit, with
no '..'. It is also a folder name under `--adapter-dir`, so it can never be a path leading out of it.
"""
from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


def check_adapter_name(name: object) -> str:
    """Return `name` when it is a valid adapter name; ValueError naming the rule otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ValueError(f"adapter name {name!r} is invalid: use 1-128 letters, digits, '.', '_', '-' or ':', "
                         "starting with a letter or digit (no '..')")
    return name
