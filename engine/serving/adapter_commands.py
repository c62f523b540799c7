"""Adapters managed over the wire: load and unload commands, loads on first use from --adapter-dir, and
the journal that registers run-time loads again after an engine restart.

Each method runs the registration (which reads and validates the files) on the engine thread through
`run`, and reports what changed through `changed` (the engine process tells every frontend at once).
Refusals are ValueError / LookupError / OSError with a message naming the problem; nothing is half done.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from engine.core.engine_core import EngineCore
from engine.serving.adapter_dir import check_load_path, resolve_adapter_dir
from engine.serving.adapter_journal import AdapterJournal
from ipc.outputs import AdapterReply, EngineStatus
from ipc.requests import AdapterCommand

log = logging.getLogger("loraplex.engine")


class AdapterCommands:
    def __init__(self, core: EngineCore, run: Callable[..., Awaitable], changed: Callable[[], Awaitable[EngineStatus]],
                 adapter_dir: str | None, lora_roots: list[str], runtime_lora: bool, journal: AdapterJournal | None):
        """run(fn, *args): fn's result, computed on the engine thread; changed(): tell the frontends."""
        self.core, self.run, self.changed = core, run, changed
        self.adapter_dir = adapter_dir
        self.lora_roots = lora_roots              # where a run-time load may read from
        self.runtime_lora = runtime_lora
        self.journal = journal

    async def restore(self) -> None:
        """Register again the adapters loaded at run time before a restart (the journal's order)."""
        if self.journal is None:
            return
        for e in list(self.journal.entries.values()):
            try:
                await self.run(self.core.register_adapter, e["name"], e["path"], e["pinned"])
                log.info("registered adapter %r again (loaded before the restart)", e["name"])
            except (ValueError, LookupError, OSError) as err:
                log.warning("adapter %r loaded before the restart cannot be registered again: %s", e["name"], err)
                self.journal.unloaded(e["name"])

    async def load_on_demand(self, name: str | None) -> None:
        """Register DIR/<name> for an adapter name not registered yet. Any failure to find or read it is
        an unknown model to the client (LookupError -> 404)."""
        adapters = self.core.adapters
        if name is None or adapters is None or name in adapters.by_name or not self.adapter_dir:
            return
        try:
            path = resolve_adapter_dir(self.adapter_dir, name)
            await self.run(self.core.register_adapter, name, str(path))
        except ValueError as e:
            raise LookupError(f"adapter {name!r} is not available: {e}") from None
        await self.changed()

    async def handle(self, cmd: AdapterCommand) -> AdapterReply:
        """load / unload / list -> the reply: ok and the adapters now registered, or the refusal."""
        try:
            if cmd.op in ("load", "unload") and not self.runtime_lora:
                raise ValueError("loading and unloading adapters at run time is turned off (--disable-runtime-lora)")
            if cmd.op == "load":
                await self._load(cmd)
            elif cmd.op == "unload":
                self.core.unregister_adapter(cmd.name)
                if self.journal is not None:
                    self.journal.unloaded(cmd.name)
            elif cmd.op != "list":
                raise ValueError(f"unknown adapter op {cmd.op!r}")
        except (ValueError, LookupError, OSError) as e:
            return AdapterReply(cmd.command_id, False, str(e.args[0]) if e.args else str(e))
        status = await self.changed()
        return AdapterReply(cmd.command_id, True, adapters=status.adapters)

    async def _load(self, cmd: AdapterCommand) -> None:
        path = cmd.path or (str(resolve_adapter_dir(self.adapter_dir, cmd.name)) if self.adapter_dir else "")
        if not path:
            raise ValueError("lora_path is required (the server has no --adapter-dir)")
        path = check_load_path(path, self.lora_roots)
        await self.run(self.core.register_adapter, cmd.name, path, cmd.pinned)
        if self.journal is not None:
            self.journal.loaded(cmd.name, path, cmd.pinned)
