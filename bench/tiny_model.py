"""Tiny random model directories (Hugging Face format, the default model's tokenizer) of every served family,
for tests and load runs that exercise the serving stack rather than the model: each step costs about a
millisecond. Built with transformers' own config and model classes, so they are what transformers loads."""
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


# family -> (the transformers config and model classes, the family's own settings at tiny size). Windowed
# families get a sliding window of WINDOW tokens, smaller than the tests' prompts plus outputs.
WINDOW = 12
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                                  "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                                  "max_window_layers": 1}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW, "pad_token_id": 0}),
    # soft-caps small enough to bite on a tiny model's scores and logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                                     "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
                                                     "pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                                         "layer_types": ["sliding_attention", "full_attention",
                                                                         "sliding_attention"], "pad_token_id": 0}),
    # 4 experts, 2 a token; Qwen3-MoE with a dense middle layer (mlp_only_layers)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"sliding_window": WINDOW, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 64, "norm_topk_prob": True,
                                                            "mlp_only_layers": [1], "use_sliding_window": True,
                                                            "sliding_window": WINDOW, "max_window_layers": 1}),
}


def make_tiny(dest: Path, tokenizer_dir: Path, family: str = "llama", layers: int = 3, seed: int = 0,
              max_positions: int = 256) -> Path:
    """A model of any family of FAMILIES with its switches on (Qwen2's biases, Qwen3's q/k norms, the
    windowed families' window on some layers): hidden 64, 4 query / 2 KV heads of 32 (the paired KV
    layout and the C decoder take 32-dim heads, not make_tiny_llama's 16). Biases and norm weights are
    random (not zeros and ones), and MoE experts and routers larger than the init's, so that a switch read
    wrongly changes the tokens."""
    import torch
    import transformers
    if (dest / "config.json").is_file():
        return dest
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **extra)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or name.endswith(("mlp.gate.weight", "moe.gate.weight")):
                p.normal_(0, 0.3)       # experts and router that move the tokens (init's 0.02 barely does)
    model.save_pretrained(dest)
    _copy_tokenizer(tokenizer_dir, dest)
    return dest


def _copy_tokenizer(src: Path, dest: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(src) / f).is_file():
            shutil.copy(Path(src) / f, dest / f)


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


# a family's own settings at full size (make_family_like): Mistral 7B's window (wider than the benchmarks'
# contexts, as in serving), Qwen's defaults (no window)
FULL_SIZE = {"mistral": {"sliding_window": 4096}, "qwen2": {}, "qwen3": {},
             "phi3": {"sliding_window": 2047, "pad_token_id": 0},
             "gemma2": {"sliding_window": 4096, "query_pre_attn_scalar": 64, "pad_token_id": 0},
             "gemma3": {"sliding_window": 512, "query_pre_attn_scalar": 64, "pad_token_id": 0}}


def make_family_like(dest: Path, src: Path, family: str, seed: int = 0) -> Path:
    """A model of `family` with src's sizes (a Llama directory: the default model), src's tokenizer files and
    seeded random bfloat16 weights: the same GEMMs and attention, plus the family's own work (Qwen2's
    biases, Qwen3's q/k norms). For speed runs of each family at the default model's size."""
    import json

    import torch
    import transformers
    if (dest / "model.safetensors").is_file():
        return dest
    torch.manual_seed(seed)
    base = json.loads((Path(src) / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "rope_theta")
    config_cls, model_cls, _ = FAMILIES[family]
    sizes = {k: base[k] for k in keep if k in base}
    sizes["head_dim"] = base.get("head_dim") or base["hidden_size"] // base["num_attention_heads"]
    cfg = getattr(transformers, config_cls)(**sizes, **FULL_SIZE[family])
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(dest)
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
