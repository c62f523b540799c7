"""Command lines handed on to a child `loraplex serve` (the Ray replicas', run-batch's)."""
from __future__ import annotations


def drop_flags(argv: list[str], flags: set[str]) -> list[str]:
    """argv without `flags` and their values (each takes one: `--flag VALUE` or `--flag=VALUE`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out
