"""--adapter-dir is listed, not read: start-up opens no adapter file whatever the folder holds; a folder
refused at first use keeps its reason until its files change."""
from __future__ import annotations

import os
import sys

from engine.serving.adapter_dir import AdapterCatalog
from tests.engine.lora.synthetic import write_adapter

_OPENED: list[str] | None = None


def _audit(event: str, args) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)      # NOTE: hooks cannot be removed; this one records only inside `opened`


def opened(fn):
    """fn() and the paths it (or anything it called in Python) opened."""
    global _OPENED
    _OPENED = []
    try:
        result = fn()
        return result, _OPENED
    finally:
        _OPENED = None


def test_a_thousand_folders_are_listed_without_opening_a_file(tmp_path):
    for i in range(1000):
        d = tmp_path / f"a{i:04d}"
        d.mkdir()
        (d / "adapter_config.json").write_text("{ not even json")
        (d / "adapter_model.safetensors").write_bytes(b"garbage")
    (tmp_path / "no-config").mkdir()
    (tmp_path / "bad name!").mkdir()
    (tmp_path / "bad name!" / "adapter_config.json").write_text("{}")
    catalog, files = opened(lambda: AdapterCatalog(str(tmp_path)))
    assert not [f for f in files if str(tmp_path) in f], files[:5]
    assert catalog.names() == {f"a{i:04d}" for i in range(1000)}


def test_a_refusal_is_remembered_until_the_folder_changes(tmp_path):
    write_adapter(tmp_path / "x", 4)
    catalog = AdapterCatalog(str(tmp_path))
    catalog.refuse("x", "r must be a positive integer")
    assert catalog.refusal("x") == "r must be a positive integer" and "x" not in catalog.names()
    cfg = tmp_path / "x" / "adapter_config.json"
    cfg.write_text(cfg.read_text() + " ")                 # a new upload: size and mtime change
    assert catalog.refusal("x") is None and "x" in catalog.names()
