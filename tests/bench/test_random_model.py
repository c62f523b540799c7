"""bench.tiny_model.make_random_like: a model of another's shape with random weights (the GPU check uses it
where the default model's file cannot be had: docs/gpu-check.md)."""
from __future__ import annotations

import json

from bench.tiny_model import make_random_like, make_tiny_llama
from engine.llm import LLM
from ipc.sampling_params import SamplingParams


def test_a_random_model_of_the_same_shape_serves(tmp_path, model_dir):
    src = make_tiny_llama(tmp_path / "src", model_dir, seed=1)
    dest = make_random_like(tmp_path / "dest", src, seed=2)
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")
    a, b = (json.loads((d / "config.json").read_text()) for d in (src, dest))
    assert {k: a[k] for k in shape} == {k: b[k] for k in shape}
    assert (dest / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [LLM(model=str(d), dtype="float32").generate([[1, 2, 3, 4]], params)[0].token_ids for d in (src, dest)]
    assert len(outs[1]) == 6 and outs[0] != outs[1]          # the same shape, other weights
