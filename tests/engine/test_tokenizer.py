"""engine/tokenizer.py: the tokenizer a frontend loads without torch (tokenizer_only) is the engine's own, class,
ids, text and chat template alike, and torch is never imported for it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny_model import make_tiny
from engine.tokenizer import encode_chat, load_tokenizer

TEXTS = ["Hello world", "  two leading spaces,  double inside", "Ünïcödé — 東京 🙂", "<|im_start|>user\nhi<|im_end|>",
         "line one\nline two\n\n", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]

PROBE = """
import json, sys
from engine.tokenizer import tokenizer_only
tokenizer_only()
from tests.engine.test_tokenizer import what_it_gives
print(json.dumps(what_it_gives(sys.argv[1])))
"""


def what_it_gives(path: str) -> dict:
    tok = load_tokenizer(path)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    return {"class": type(tok).__name__, "ids": ids, "text": [tok.decode(i) for i in ids],
            "pieces": [tok.decode([i]) for i in ids[2]], "chat": encode_chat(tok, CHAT),
            "torch": sys.modules.get("torch") is not None}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_frontends_tokenizer_is_the_engines(family, model_dir, tmp_path):
    path = model_dir if family == "llama" else make_tiny(tmp_path / family, model_dir, family)
    r = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).parents[2])     # the probe imports this module
    assert r.returncode == 0, r.stderr
    assert "PyTorch was not found" not in r.stderr
    theirs = json.loads(r.stdout)
    assert theirs.pop("torch") is False
    ours = what_it_gives(str(path))
    assert ours.pop("torch") is True
    assert theirs == ours
