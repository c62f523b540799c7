"""Adapters managed over the wire: load and unload commands, loads on first use from --adapter-dir, and
the journal that registers run-time loads again after an engine restart.

Each method runs the registration on the engine thread through `run`; registering reads only the adapter's
config and safetensors header (2-3 ms here), never its weights: those are read by the loader, beside
the step, when a request first needs them. What changed is told through `changed` (the engine process tells
every frontend at once). Refusals are ValueError / LookupError / OSError with a message naming the problem;
nothing is half done. `--adapter-dir` is listed at start-up, not read (`AdapterCatalog`); a folder refused
at first use, or whose weights failed to load, is refused again at once with the same reason until its
files change.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from engine.core.engine_core import EngineCore
from engine.lora.host_adapter import files_signature
from engine.serving.adapter_dir import AdapterCatalog, check_load_path, resolve_adapter_dir
from engine.serving.adapter_journal import AdapterJournal
from engine.serving.adapter_source import AdapterSource
from ipc.outputs import AdapterReply, EngineStatus
from ipc.requests import AdapterCommand

log = logging.getLogger("loraplex.engine")


class AdapterCommands:
    def __init__(self, core: EngineCore, run: Callable[..., Awaitable], changed: Callable[[], Awaitable[EngineStatus]],
                 adapter_dir: str | None, lora_roots: list[str], runtime_lora: bool, journal: AdapterJournal | None,
                 source: AdapterSource | None = None):
        """run(fn, *args): fn's result, computed on the engine thread; changed(): tell the frontends;
        source: --adapter-source, whose cache is looked in after --adapter-dir."""
        self.core, self.run, self.changed, self.source = core, run, changed, source
        self.adapter_dir = adapter_dir
        self.catalog = AdapterCatalog(adapter_dir) if adapter_dir else None
        self.lora_roots = lora_roots              # where a run-time load may read from
        self.runtime_lora = runtime_lora
        self.journal = journal

    async def restore(self) -> None:
        """Register again the adapters loaded at run time before a restart (the journal's order)."""
        if self.journal is None:
            return
        for e in list(self.journal.entries.values()):
            try:
                await self._register(e["name"], e["path"], e["pinned"])
                log.info("registered adapter %r again (loaded before the restart)", e["name"])
            except (ValueError, LookupError, OSError) as err:
                log.warning("adapter %r loaded before the restart cannot be registered again: %s", e["name"], err)
                self.journal.unloaded(e["name"])

    async def _register(self, name: str, path: str, pinned: bool = False) -> None:
        """Register on the engine thread, hashing nothing there: digests come in the background, and twins
        of one content are merged once they are known (AdapterManager.register, hash_now=False)."""
        await self.run(self.core.register_adapter, name, path, pinned, False)

    def digest(self, name: str) -> str:
        """The content digest of a registered adapter; "" for a name only listed in --adapter-dir."""
        a = self.core.adapters.by_name.get(name) if self.core.adapters is not None else None
        return a.digest if a is not None else ""

    def names(self) -> list[str]:
        """The adapters a client may name: those registered and those listed in --adapter-dir, but for those
        whose weights failed to load, while their files are unchanged (every request for them is a 404)."""
        adapters = self.core.adapters
        registered = set(adapters.names()) if adapters is not None else set()
        listed = self.catalog.names() if self.catalog is not None else set()
        failed = {n for n in registered if (a := adapters.by_name[n]).error is not None
                  and files_signature(a.path) == a.files.signature}
        return sorted(listed.union(registered) - failed)

    def knows(self, name: str) -> bool:
        """Whether the server has adapter `name` without the remote store: registered, or a folder of
        --adapter-dir."""
        adapters = self.core.adapters
        if adapters is not None and name in adapters.by_name:
            return True
        try:
            return bool(self.adapter_dir) and resolve_adapter_dir(self.adapter_dir, name) is not None
        except (ValueError, LookupError):
            return False

    def _listed_only(self, name: str) -> bool:
        adapters = self.core.adapters
        return (self.catalog is not None and name in self.catalog.names() and adapters is not None
                and name not in adapters.by_name)

    async def load_on_demand(self, name: str | None) -> None:
        """Register DIR/<name> for an adapter name not registered yet. Any failure to find or read it is
        an unknown model to the client (LookupError -> 404), with the reason; a folder refused before is
        refused at once while its files are unchanged."""
        adapters = self.core.adapters
        if name is None or adapters is None:
            return
        a = adapters.by_name.get(name)
        if a is not None:
            if a.error is None:
                return
            if files_signature(a.path) == a.files.signature:
                raise LookupError(f"adapter {name!r} is not available: its weights failed to load: {a.error}")
            try:                            # changed on disk since: describe it again
                await self._register(name, str(a.path), a.pinned)
            except ValueError as e:
                raise LookupError(f"adapter {name!r} is not available: {e}") from None
            return
        if self.source is not None and not self.knows(name):
            return await self._from_source(name)
        if not self.adapter_dir:
            return
        why = self.catalog.refusal(name)
        if why is not None:
            raise LookupError(f"adapter {name!r} is not available: {why}")
        try:
            path = resolve_adapter_dir(self.adapter_dir, name)
            await self._register(name, str(path))
        except ValueError as e:
            self.catalog.refuse(name, str(e))
            await self.changed()            # /v1/models stops listing it
            raise LookupError(f"adapter {name!r} is not available: {e}") from None
        self.catalog.listed.add(name)
        await self.changed()

    async def _from_source(self, name: str, pinned: bool = False) -> str:
        """Register `name` from the remote store's cache (engine/serving/adapter_fetches.py fetched it) ->
        its folder; a cached folder the engine refuses is removed and the refusal remembered, so a fixed
        store is asked again later."""
        why = self.source.refusal(name)
        if why is not None:
            raise LookupError(why)
        path = self.source.cached(name)
        if path is None:
            raise LookupError(f"adapter {name!r} is not registered")
        try:
            await self._register(name, str(path), pinned)
        except ValueError as e:
            self.source.drop(name)
            self.source.refuse(name, f"adapter {name!r} from {self.source.file_url(name, '')}: {e}")
            raise LookupError(f"adapter {name!r} is not available: {e}") from None
        await self.changed()
        return str(path)

    async def handle(self, cmd: AdapterCommand) -> AdapterReply:
        """load / unload / list -> the reply: ok and the adapters now registered, or the refusal."""
        try:
            if cmd.op in ("load", "unload") and not self.runtime_lora:
                raise ValueError("loading and unloading adapters at run time is turned off (--disable-runtime-lora)")
            if cmd.op == "load":
                await self._load(cmd)
            elif cmd.op == "unload":
                if not self._listed_only(cmd.name):     # listed in --adapter-dir, never read: nothing to free
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
        if not cmd.path and self.source is not None and not self.knows(cmd.name):
            path = await self._from_source(cmd.name, cmd.pinned)       # fetched while the command waited
        else:
            path = cmd.path or (str(resolve_adapter_dir(self.adapter_dir, cmd.name)) if self.adapter_dir else "")
            if not path:
                raise ValueError("lora_path is required (the server has no --adapter-dir or --adapter-source)")
            path = check_load_path(path, self.lora_roots)
            await self._register(cmd.name, path, cmd.pinned)
        await self.run(self.core.prefetch_adapter, cmd.name)      # its weights load beside the steps
        if self.journal is not None:
            self.journal.loaded(cmd.name, path, cmd.pinned)
