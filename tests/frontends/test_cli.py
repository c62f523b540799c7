import json
import subprocess
import sys

import pytest

from bench.tiny_model import make_tiny
from tests.conftest import cli_in_process


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "frontends.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_chat_json_answers_paris():
    r = run_cli("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop" and out["token_ids"]


def test_bad_argument_is_a_clear_error():
    r = run_cli("generate", "--prompt", "hi", "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral",
                                    "qwen3_moe"])
def test_generate_serves_each_family_as_transformers_does(family, tmp_path, model_dir, capsys):
    """`loraplex generate --model DIR` on a tiny model of each family: transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = make_tiny(tmp_path / family, model_dir, family)
    prompt = "The quick brown fox jumps over the lazy dog while the cat"
    rc, out, err = cli_in_process(capsys, "generate", "--model", str(d), "--dtype", "float32", "--prompt", prompt,
                                  "--max-tokens", "6", "--ignore-eos", "--json")
    assert rc == 0, err
    ids = AutoTokenizer.from_pretrained(d)(prompt, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert json.loads(out)["token_ids"] == want
