"""Adapters loaded at run time (over HTTP or ZMQ), kept in a JSON file so that a restarted engine
registers them again before it serves: a crash does not lose a tenant's adapter, nor the requests the
frontends resend for it.

File: {"adapters": [{"name": ..., "path": ..., "pinned": ...}, ...]} in load order; written to a
temporary file and renamed into place, so a crash mid-write leaves the previous version.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


class AdapterJournal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries: dict[str, dict] = {e["name"]: e for e in self._read()}

    def _read(self) -> list[dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError):
            return []          # unreadable: start empty rather than refuse to start
        items = data.get("adapters", []) if isinstance(data, dict) else []
        return [{"name": e["name"], "path": e["path"], "pinned": e.get("pinned", False)} for e in items
                if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("path"), str)
                and isinstance(e.get("pinned", False), bool)]

    def loaded(self, name: str, path: str, pinned: bool) -> None:
        self.entries.pop(name, None)               # keep load order: a reload moves it last
        self.entries[name] = {"name": name, "path": path, "pinned": pinned}
        self._write()

    def unloaded(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".adapters-")
        with os.fdopen(fd, "w") as f:
            json.dump({"adapters": list(self.entries.values())}, f)
        os.replace(tmp, self.path)
