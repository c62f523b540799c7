"""The one module that reads environment variables."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> str:
    """Where converted models live: $LORAPLEX_CACHE, else ~/.cache/loraplex."""
    return os.environ.get("LORAPLEX_CACHE") or str(Path.home() / ".cache" / "loraplex")


def adapter_source_token(hub: bool = False) -> str | None:
    """A bearer token for --adapter-source (a private store): $LORAPLEX_ADAPTER_SOURCE_TOKEN; for a Hugging
    Face Hub source (hub), else $HF_TOKEN."""
    return os.environ.get("LORAPLEX_ADAPTER_SOURCE_TOKEN") or (os.environ.get("HF_TOKEN") if hub else None) or None


def hf_endpoint() -> str:
    """The Hugging Face Hub an `hf://` adapter source names: $HF_ENDPOINT, else https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def adapter_cache_dir(source: str) -> str:
    """Where adapters fetched from `source` are kept: $LORAPLEX_CACHE/adapters/<a hash of the URL>."""
    import hashlib
    return str(Path(cache_dir()) / "adapters" / hashlib.sha256(source.encode()).hexdigest()[:16])


def num_threads() -> int:
    """Torch intra-op threads for the forward pass: $LORAPLEX_NUM_THREADS, else all cores."""
    value = os.environ.get("LORAPLEX_NUM_THREADS")
    return int(value) if value else (os.cpu_count() or 1)


def cpu_kernels_enabled() -> bool:
    """Use the C kernels of kernels/cpu (built on first use with the system's C compiler) unless
    $LORAPLEX_CPU_KERNELS is 0."""
    return os.environ.get("LORAPLEX_CPU_KERNELS", "1") != "0"


def c_decoder() -> bool:
    """Run steps through kernels/cpu/csrc/decoder.c (all layers in one C call, where it runs) unless
    $LORAPLEX_C_DECODER is 0 (then op by op, with the same bits)."""
    return os.environ.get("LORAPLEX_C_DECODER", "1") != "0"


def log_level() -> str:
    return os.environ.get("LORAPLEX_LOG_LEVEL", "INFO")


def api_key() -> str | None:
    """The key HTTP clients must send as a Bearer token; set by `loraplex serve --api-key`."""
    return os.environ.get("LORAPLEX_API_KEY") or None


def ingress_metrics_key() -> str | None:
    """The key the Ray Serve ingress reads a replica's /metrics with (its load poll), set by the replica
    deployment: it opens /metrics and nothing else, and leaves /metrics open when no key is configured."""
    return os.environ.get("LORAPLEX_INGRESS_METRICS_KEY") or None


def auth_config() -> dict | None:
    """The `[auth]` table of the config file: as JSON in the file $LORAPLEX_AUTH_FILE names (written by `loraplex
    serve`, and again at each reload: SIGHUP), else in $LORAPLEX_AUTH."""
    import json
    path = os.environ.get("LORAPLEX_AUTH_FILE")
    if path:
        with open(path) as f:
            return json.load(f)
    value = os.environ.get("LORAPLEX_AUTH")
    return json.loads(value) if value else None


def prometheus_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
