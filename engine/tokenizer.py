"""The base model's tokenizer (Hugging Face `tokenizers` via transformers) and chat template.

transformers is imported when a tokenizer is loaded, not with this module: a frontend process imports it
without torch (`tokenizer_only`), the engine with it."""
from __future__ import annotations

import os
import sys
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
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def encode_chat(tok: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Apply the model's chat template with the assistant prompt appended; return token ids."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")
    if tok.chat_template is None:
        raise ValueError("this model has no chat template: use /v1/completions with a prompt")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]
