"""Adapters loaded at run time (over HTTP or ZMQ), kept in a file so that a restarted engine registers
them again before it serves: a crash does not lose a tenant's adapter, nor the requests the frontends
resend for it.

File: JSON Lines, appended to: `{"load": {"name": ..., "path": ..., "pinned": ...}}` or
`{"unload": NAME}`, one per call, so a load or unload costs one short write whatever the number of
adapters (rewriting the whole list per call made 5,000 loads take 55 s). Replayed in order at start,
where a line that does not parse (a write cut short by a crash) is skipped; then, and whenever the log
holds more than twice the live entries (plus COMPACT_SLACK lines), it is compacted: the live entries are
written to a temporary file that is renamed into place, so a crash mid-way leaves the previous file.
A line `{"adapters": [...]}` (this file's earlier, whole-list format) is read as loads.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

COMPACT_SLACK = 1000


class AdapterJournal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries: dict[str, dict] = {}       # name -> entry, in load order
        self.lines = 0                           # lines in the file
        self._replay()
        self._compact()

    # -- reading ------------------------------------------------------------------------------------------
    def _replay(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            return             # unreadable: start empty rather than refuse to start
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self._apply(record)

    def _apply(self, record: dict) -> None:
        for e in record.get("adapters", []) if isinstance(record.get("adapters"), list) else []:
            self._apply({"load": e})
        e = record.get("load")
        if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("path"), str) \
                and isinstance(e.get("pinned", False), bool):
            self._set(e["name"], e["path"], e.get("pinned", False))
        if isinstance(record.get("unload"), str):
            self.entries.pop(record["unload"], None)

    def _set(self, name: str, path: str, pinned: bool) -> None:
        self.entries.pop(name, None)               # keep load order: a reload moves it last
        self.entries[name] = {"name": name, "path": path, "pinned": pinned}

    # -- writing ------------------------------------------------------------------------------------------
    def loaded(self, name: str, path: str, pinned: bool) -> None:
        self._set(name, path, pinned)
        self._append({"load": self.entries[name]})

    def unloaded(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self._append({"unload": name})

    def _append(self, record: dict) -> None:
        if self.lines > 2 * len(self.entries) + COMPACT_SLACK:
            self._compact()          # the live entries include this record's effect already
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.lines += 1

    def _compact(self) -> None:
        """Rewrite the file as the live entries' load lines (temporary file, then rename)."""
        if not self.entries and not self.path.exists():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".adapters-")
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps({"load": e}) + "\n" for e in self.entries.values())
        os.replace(tmp, self.path)
        self.lines = len(self.entries)
