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


def make_random_like(dest: Path, src: Path, seed: int = 0) -> Path:
    """A model of src's shape with random weights: src's config and tokenizer files, seeded weights in
    float32 (as the converted default model). For runs that need the shape and not the weights (speed; the
    engine against transformers + PEFT on the same weights) where the real weights cannot be had."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    if (dest / "model.safetensors").is_file():
        return dest
    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(src)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(dest)
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, dest / f.name)
    return dest


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="Write a model of SRC's shape (config.json and tokenizer files) "
                                            "with random weights into DEST.")
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(make_random_like(args.dest, args.src, args.seed))
