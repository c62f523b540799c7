"""SIGHUP to `loraplex serve`: the config file's [auth] table is read again (keys, tenants, what each may use,
their queue bounds and rate limits) and takes effect in every frontend without a restart, so keys rotate and
tenants come and go while streams run.

The launcher keeps the table as JSON in one file of its run folder, which every frontend reads at its start
(also a frontend restarted after a crash) and again at its own SIGHUP (envs.auth_config). At a reload the
launcher reads the config file, checks the table as a frontend would (frontends/auth.py: a table it refuses
is logged, naming the setting, and the running one stays), writes it whole (a new file renamed over the
old: a frontend never reads half of one), then sends each frontend SIGHUP. `--api-key` and `--metrics-key`
stay as given at the start. Other settings need a restart. Only a server started with --config reloads: one
without keeps SIGHUP's old meaning (a closed terminal stops it). With one, a closed terminal's SIGHUP (to every
process) is a reload too: the engine ignores SIGHUP, and the launcher goes on draining its children's output
where it has nowhere left to write it (launcher.say).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from frontends.auth import parse_auth


class AuthFile:
    def __init__(self, path: Path, source: Callable[[], dict | None] | None, api_key: str | None):
        """source: the table as the config file says it now (None: no config file, nothing to reload)."""
        self.path, self.source, self.api_key = path, source, api_key

    def write(self, table: dict | None) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, self.path)

    def reload(self) -> str:
        """Read, check and write the table again -> what it now holds; ValueError / OSError naming what is
        wrong (the file is then left as it was)."""
        if self.source is None:
            raise ValueError("no --config file to read the [auth] table from")
        table = self.source()
        auth = parse_auth(table, self.api_key)
        self.write(table)
        return f"{len(auth.admin_keys)} admin key(s), {len(auth.tenants)} tenant(s)"
