"""An adapter's identity by content: "sha256:<hex>" over what decides its computation (the LoRA settings
of its adapter_config.json as loraplex reads them: rank, alpha, rsLoRA, patterns, targets, layers) and the
bytes of its weights file. Two folders with one content have one digest, whatever their names, paths or
PEFT metadata; a folder re-written with other weights has another.

Hashing reads the whole weights file (sha256: ~1.3 GB/s here, 30 ms for a 39 MB adapter, three times its
cold load), so it stays off the serving path: `shape_key` (the settings, the safetensors header and the
file's size; no weights read) tells apart almost every two different adapters, and only adapters sharing
a shape key can be one content. The offline API hashes such twins when one is registered; the server
compares only digests already known, and every adapter's digest is computed in the background after
registration, at full speed only while the engine is idle (AdapterManager._digest_later), after which
twins of one content are merged into one adapter. Digests are remembered by the folder's files signature
(sizes and mtimes), so a folder unchanged since is not read again."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from pathlib import Path

from engine.lora.host_adapter import AdapterFiles, files_signature, weights_file
from engine.lora.peft_config import read_spec

_known: dict[tuple[str, tuple[int, ...]], str] = {}
_lock = threading.Lock()


CHUNK = 1 << 20


def _settings(d: Path) -> bytes:
    return _spec_settings(read_spec(d))


def _spec_settings(spec) -> bytes:
    spec = dataclasses.asdict(spec)
    spec.pop("base_model", None)                 # metadata: the same weights saved from two places agree
    return json.dumps(spec, sort_keys=True, default=list).encode()


def shape_key(files: AdapterFiles) -> str:
    """What two adapters of one content certainly share (and two different ones almost never do): the
    settings, the weights file's safetensors header (names, dtypes, shapes, offsets) and its size, as
    describe_adapter found them (no file is read again)."""
    h = hashlib.sha256(_spec_settings(files.spec))
    h.update(files.header_sha256)
    h.update(str(files.nbytes).encode())
    return h.hexdigest()


def known_digest(adapter_dir: str | Path) -> str:
    """The digest content_digest computed for this folder as it is now, or "" (nothing is read)."""
    d = Path(adapter_dir).resolve()
    with _lock:
        return _known.get((str(d), files_signature(d)), "")


def content_digest(adapter_dir: str | Path, pace=None) -> str:
    """pace(): called between chunks of CHUNK bytes (the loader's: it rests while a step computes)."""
    d = Path(adapter_dir).resolve()
    key = (str(d), files_signature(d))
    with _lock:
        if key in _known:
            return _known[key]
    h = hashlib.sha256(_settings(d))
    weights = hashlib.sha256()
    with open(weights_file(d), "rb") as f:
        while chunk := f.read(CHUNK):
            weights.update(chunk)
            if pace is not None:
                pace()
    h.update(weights.digest())
    digest = "sha256:" + h.hexdigest()
    with _lock:
        _known[key] = digest
    return digest
