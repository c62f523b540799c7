"""Turn a user's `model` argument into a local Hugging Face directory."""
from __future__ import annotations

from pathlib import Path


def resolve_model(model: str) -> tuple[Path, str]:
    """Return (directory, served name). "default" is the bundled SmolLM2-135M-Instruct."""
    if model == "default":
        from engine.model.default_model import DEFAULT_MODEL_NAME, default_model_dir
        return default_model_dir(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model: {model!r} is not a directory (no model hub is used; give a local "
                         f"Hugging Face model directory of a served family or 'default')")
    return path, path.name
