"""engine/tokenizer.py: the tokenizer a frontend loads without torch (tokenizer_only) is the engine's own, class,
ids, text and chat template alike, and torch is never imported for it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny_model import make_tiny
from engine.tokenizer import encode_chat, generic_tokenizer_folder, load_tokenizer

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


# model_type of each served family's config (bench/tiny_model.py FAMILIES), and two AutoTokenizer overrides
MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe"]


def tokenizer_folder(tmp_path: Path, model_dir: Path, model_type: str, **tok_cfg) -> str:
    """The default model's tokenizer files beside a config.json of `model_type` (its defaults)."""
    out = tmp_path / model_type
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "chat_template.jinja"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    cfg = {**json.loads((model_dir / "tokenizer_config.json").read_text()), **tok_cfg}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(out)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_tokenizer_is_autotokenizers_without_building_the_config(model_type, model_dir, tmp_path):
    from transformers import AutoTokenizer
    from transformers.models.auto import tokenization_auto as auto
    path = tokenizer_folder(tmp_path, model_dir, model_type)
    # the direct path, but for the types AutoTokenizer maps to a class of their own (Qwen2's, Phi-3's)
    overridden = (auto.TOKENIZER_MAPPING_NAMES.get(model_type) == "MistralCommonBackend"
                  or model_type in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    assert generic_tokenizer_folder(path) is not overridden
    assert model_type not in ("llama", "gemma3_text", "qwen3") or not overridden
    auto_tok = AutoTokenizer.from_pretrained(path)
    tok = load_tokenizer(path)
    assert type(tok) is type(auto_tok)
    for text in TEXTS:
        assert tok(text)["input_ids"] == auto_tok(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"]) == auto_tok.decode(auto_tok(text)["input_ids"])
    assert encode_chat(tok, CHAT) == encode_chat(auto_tok, CHAT)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (auto_tok.bos_token_id, auto_tok.eos_token_id, auto_tok.pad_token_id)


@pytest.mark.parametrize("change", ["own code", "another class", "a type AutoTokenizer overrides", "no config"])
def test_other_folders_go_through_autotokenizer(change, model_dir, tmp_path):
    from transformers.models.auto import tokenization_auto as auto
    assert generic_tokenizer_folder(tokenizer_folder(tmp_path, model_dir, "llama"))
    kind = "qwen2" if change.startswith("a type") else "llama"
    assert change != "a type AutoTokenizer overrides" or kind in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    extra = {"own code": {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}},
             "another class": {"tokenizer_class": "LlamaTokenizer"}}.get(change, {})
    path = tokenizer_folder(tmp_path / "changed", model_dir, kind, **extra)
    if change == "no config":
        (Path(path) / "config.json").unlink()
    assert not generic_tokenizer_folder(path)


def test_chat_template_variables_and_a_continued_last_turn():
    """vLLM's chat_template_kwargs (more variables for the template) and continue_final_message."""
    from engine.model.default_model import default_model_dir
    from engine.tokenizer import encode_chat, load_tokenizer
    tok = load_tokenizer(str(default_model_dir()))
    template = ("{% if shout %}LOUD {% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% if not (loop.last and continue_final_message) %}</{{ m.role }}>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    assert tok.decode(encode_chat(tok, turns, chat_template=template)) == \
        "<user>Hi</user><assistant>Hello the</assistant><assistant>"
    assert tok.decode(encode_chat(tok, turns, chat_template=template, template_kwargs={"shout": True},
                                  continue_final=True)) == "LOUD <user>Hi</user><assistant>Hello the"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set messages, tools"):
        encode_chat(tok, turns, chat_template=template, template_kwargs={"tools": [], "messages": []})
    with pytest.raises(ValueError, match="may not set return_tensors"):      # apply_chat_template's own
        encode_chat(tok, turns, chat_template=template, template_kwargs={"return_tensors": "pt"})
