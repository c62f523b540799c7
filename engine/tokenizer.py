"""The base model's tokenizer (Hugging Face `tokenizers` via transformers) and chat template.

transformers is imported when a tokenizer is loaded, not with this module: a frontend process imports it
without torch (`tokenizer_only`), the engine with it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def tokenizer_only() -> None:
    """For a process that tokenizes and never computes (an HTTP frontend): transformers then loads its
    tokenizers, the same classes and files, without importing torch, which took more than half of a
    frontend's start (~3 of ~7 s of CPU on an AMD EPYC Zen 3). A None entry in sys.modules makes `import torch`
    fail and importlib's find_spec report it absent, which is how transformers checks. Call it before
    anything imports transformers; a process that has torch already keeps it."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")   # its "PyTorch was not found" line


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(path)` gives. AutoTokenizer builds the model's config to
    choose the class, and importing a config class costs ~2 s (Llama's pulls in `torch.distributed.tensor`),
    on the path of every engine's and frontend's start. A folder whose tokenizer_config.json names
    transformers' generic class (what `save_pretrained` writes for a tokenizer.json), for a model type that
    AutoTokenizer does not override, gets that class directly; every other folder goes through AutoTokenizer
    (tests/engine/test_tokenizer.py checks the two agree for every served family)."""
    if generic_tokenizer_folder(path):
        from transformers import TokenizersBackend
        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def generic_tokenizer_folder(path: str) -> bool:
    """Whether AutoTokenizer would load `path` as `TokenizersBackend` whatever the model's config class:
    tokenizer_config.json names it, with no code of its own (auto_map), and config.json's model type is not
    one AutoTokenizer maps elsewhere (its list of hub folders with a wrong class; Mistral's own backend)."""
    folder = Path(path)
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        model_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not (folder / "tokenizer.json").is_file() or tok_cfg.get("tokenizer_class") != "TokenizersBackend":
        return False
    if "auto_map" in tok_cfg or "model_name" in model_cfg or not isinstance(model_cfg.get("model_type"), str):
        return False
    from transformers.models.auto import tokenization_auto as auto
    kind = model_cfg["model_type"]
    registered = (auto.TOKENIZER_MAPPING_NAMES.get(kind) or "").removesuffix("Fast")
    return kind not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS and registered != "MistralCommonBackend"


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None,
                chat_template: str | None = None, template_kwargs: dict | None = None,
                continue_final: bool = False) -> list[int]:
    """Apply the chat template (`chat_template`, or the model's own) with the assistant prompt appended
    (continue_final: instead, the last turn left open for the model to go on with); return token ids. Each
    message has a role and string content ("" for an assistant turn that only calls tools); `tools`
    (OpenAI's function definitions) reach the template as its `tools` variable, which tool-aware templates
    describe to the model (others ignore it); `template_kwargs` are more of its variables (vLLM's
    `chat_template_kwargs`: Qwen3's `enable_thinking`, say)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")
    template = chat_template or tok.chat_template
    if template is None:
        raise ValueError("this model has no chat template: use /v1/completions with a prompt, or give the "
                         "server one (--chat-template)")
    reserved = _template_parameters(tok) & set(template_kwargs or {})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    text = tok.apply_chat_template(messages, tools=tools or None, chat_template=template,
                                   add_generation_prompt=not continue_final, continue_final_message=continue_final,
                                   tokenize=False, **(template_kwargs or {}))
    return tok(text, add_special_tokens=False)["input_ids"]


def read_chat_template(path: str | None) -> str | None:
    """--chat-template: a Jinja file's text (None: the model's own template)."""
    if not path:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template: cannot read {path}: {e}") from None


def _template_parameters(tok: PreTrainedTokenizerBase) -> set[str]:
    """The names apply_chat_template takes itself (return_tensors, tokenize, ...): never template variables."""
    import inspect
    params = inspect.signature(tok.apply_chat_template).parameters
    return {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD} | {"messages"}
