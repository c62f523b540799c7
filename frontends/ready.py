"""The one readiness protocol of loraplex's processes: when a process is ready it prints one JSON line on
stdout, `{"ready": true, ...}`, and whoever started it reads that line (never a human sentence).

- the engine process: {"ready": true, "model": name}
- an HTTP frontend: {"ready": true, "frontend": id}
- `loraplex serve` (the launcher): {"ready": true, "url": "http://host:port", "model": name,
  "engine_address": "ipc://...", "pid": its own pid, "engine_pid": ..., "frontend_pids": [...]};
  with `--replicas N`: {"ready": true, "url": ..., "replicas": N, "pid": ...}
The launcher also says where it listens in words, on stderr, for people.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable


def line(**info) -> str:
    """The ready line with these fields."""
    return json.dumps({"ready": True, **info})


def announce(**info) -> None:
    """Print the ready line (stdout, flushed)."""
    print(line(**info), flush=True)


def parse(line: str) -> dict | None:
    """The ready line's fields, or None for any other line."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        info = json.loads(line)
    except json.JSONDecodeError:
        return None
    return info if isinstance(info, dict) and info.get("ready") is True else None


def wait_for(lines: Iterable[str], echo=None) -> dict:
    """Read `lines` (a child's stdout) until its ready line: -> its fields. Every other line is passed to
    `echo` (default: written to our stderr). RuntimeError if the lines end first."""
    for line in lines:
        info = parse(line)
        if info is not None:
            return info
        (echo or sys.stderr.write)(line)
    raise RuntimeError("the process ended before it was ready")
