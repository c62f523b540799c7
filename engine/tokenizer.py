"""The base model's tokenizer (Hugging Face `tokenizers` via transformers) and chat template."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
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
