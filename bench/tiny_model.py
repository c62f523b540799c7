"""A tiny random Llama directory (Hugging Face format, the default model's tokenizer), for tests and load
runs that exercise the serving stack rather than the model: each step costs about a millisecond."""
from __future__ import annotations

import shutil
from pathlib import Path


def make_tiny_llama(dest: Path, tokenizer_dir: Path, layers: int = 2, seed: int = 0,
                    max_positions: int = 256) -> Path:
    """Write the model to dest (once) and return dest. hidden 64, 4 query / 2 KV heads of 16, vocabulary
    and tokenizer those of tokenizer_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if (dest / "config.json").is_file():
        return dest
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / f).is_file():
            shutil.copy(Path(tokenizer_dir) / f, dest / f)
    return dest
