"""DoRA adapters (engine/lora/dora.py) against PEFT's own DoRA layers: DoRA rows (ranks, targets, rsLoRA and
patterns), plain LoRA rows, a composition of LoRA adapters and base rows in one mixed batch, float32 greedy
tokens equal to PEFT's on every backend, and on the families with biases (Qwen2) and fused checkpoints
(Phi-3). The row scales are computed once, at load, by the loader; a reload from the host tier reads them
back; what cannot be served is refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.tiny_model import make_tiny
from engine.lora import dora
from ipc.sampling_params import SamplingParams
from tests.engine.lora.test_compose import engine
from tests.engine.lora.test_fidelity import peft_greedy
from tests.engine.test_backend_fidelity import PROMPTS
from tests.kernels.backends import available_backends
from tests.peft_adapters import ALL, make_adapters

SPECS = {
    "dora-qv": {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj"]},
    "dora-all": {"r": 8, "lora_alpha": 16, "use_dora": True, "target_modules": ALL},
    "dora-rs": {"r": 16, "lora_alpha": 8, "use_rslora": True, "use_dora": True, "target_modules": ["o_proj", "up_proj",
                                                                                                   "k_proj"],
                "rank_pattern": {"up_proj": 6}},
    "lora-all": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "lora-mlp": {"r": 6, "lora_alpha": 3, "target_modules": ["gate_proj", "down_proj"]},
}
TWO = [("lora-all", 0.5), ("lora-mlp", -1.5)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _oracle(d, family: str, specs: dict, compose: bool):
    from transformers import AutoModelForCausalLM
    make_tiny(d / "model", _tokenizer_dir(), family)
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32).eval()
    oracle = make_adapters(model, d / "adapters", specs, seed=5, std=0.3)
    if compose:
        oracle.add_weighted_adapter([n for n, _ in TWO], [w for _, w in TWO], "two", combination_type="cat")
    return oracle


def _tokenizer_dir():
    from engine.model.default_model import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("dora")
    return d, _oracle(d, "llama", SPECS, compose=True)


@pytest.mark.parametrize("backend", available_backends())
def test_dora_rows_match_peft_in_one_mixed_batch(backend, tiny):
    d, oracle = tiny
    jobs = [("dora-all", "dora-all"), (None, None), ("lora-all", "lora-all"), ("dora-qv", "dora-qv"),
            (TWO, "two"), ("dora-rs", "dora-rs"), ("dora-all", "dora-all")]
    n = 4 if backend == "triton" else 8            # (the Triton interpreter takes ~5 s a token here)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(jobs))]
    outs = engine(d, backend, names=SPECS).generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                                            ignore_eos=True),
                                                    adapter=[a for a, _ in jobs])
    want = [peft_greedy(oracle, name, ids, n) for (_, name), ids in zip(jobs, prompts)]
    assert [o.token_ids for o in outs] == want


def test_the_magnitudes_matter(tiny, tmp_path):
    """The same A and B served as a plain LoRA adapter (magnitudes dropped) answer otherwise."""
    d, oracle = tiny
    _copy_adapter(d / "adapters" / "dora-all", tmp_path / "as-lora", edit_config=lambda c: {**c, "use_dora": False},
                  edit_weights=lambda w: {k: v for k, v in w.items() if "magnitude" not in k})
    llm = engine(d, names=["dora-all"])
    llm.register_adapter("as-lora", str(tmp_path / "as-lora"))
    outs = llm.generate([PROMPTS[0]] * 2, GREEDY, adapter=["dora-all", "as-lora"])
    assert outs[0].token_ids == peft_greedy(oracle, "dora-all", PROMPTS[0], 8)
    assert outs[1].token_ids != outs[0].token_ids


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_dora_on_families_with_biases_and_fused_projections(family, tmp_path):
    specs = {"dora": {"r": 4, "lora_alpha": 8, "use_dora": True,
                      "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3"
                      else ["q_proj", "k_proj", "v_proj", "down_proj"]},
             "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]}}
    oracle = _oracle(tmp_path, family, specs, compose=False)
    jobs = ["dora", None, "lora", "dora"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(jobs))]
    for backend in available_backends()[:2]:
        outs = engine(tmp_path, backend, names=specs).generate(prompts, GREEDY, adapter=jobs)
        assert [o.token_ids for o in outs] == [peft_greedy(oracle, n, ids, 8) for n, ids in zip(jobs, prompts)], backend


def test_scales_are_computed_once_at_load_and_kept_by_the_host_tier(tiny, monkeypatch):
    d, oracle = tiny
    calls = []
    real = dora.scales

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(dora, "scales", counted)
    llm = engine(d, names=["dora-all"])
    want = peft_greedy(oracle, "dora-all", PROMPTS[1], 8)
    for _ in range(2):
        assert llm.generate([PROMPTS[1]], GREEDY, adapter="dora-all")[0].token_ids == want
    assert len(calls) == 1, "one load, one computation: none per step"
    m = llm.engine.adapters
    a = m.lookup("dora-all")
    llm.engine.settle()
    assert m.evict_idle(len(a.pages)) >= 1 and not a.pages
    hits = m.stats.host_hits
    out = llm.generate([PROMPTS[2]], GREEDY, adapter="dora-all")[0]
    assert m.stats.host_hits == hits + 1 and len(calls) == 1, "reloaded from its host copy, scales and all"
    assert out.token_ids == peft_greedy(oracle, "dora-all", PROMPTS[2], 8)


def test_a_dora_adapter_is_not_composed(tiny):
    d, _ = tiny
    llm = engine(d, names=SPECS)
    with pytest.raises(ValueError, match="'dora-qv' is a DoRA adapter"):
        llm.generate([PROMPTS[0]], GREEDY, adapter=[[("lora-all", 1.0), ("dora-qv", 0.5)]])
    assert llm.generate([PROMPTS[0]], GREEDY, adapter="dora-qv")[0].token_ids   # it still serves alone


def _copy_adapter(src, dst, edit_config=None, edit_weights=None):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(edit_config(cfg) if edit_config else cfg))
    w = load_file(src / "adapter_model.safetensors")
    save_file(edit_weights(w) if edit_weights else w, dst / "adapter_model.safetensors")
    return dst


def _first_magnitude(w):
    return next(k for k in sorted(w) if k.endswith("lora_magnitude_vector"))


@pytest.mark.parametrize("case, match", [
    ("missing", "has no lora_magnitude_vector"),
    ("shape", r"DoRA needs floating point \(128,\)"),
    ("not dora", "not supported"),
    ("experts", "target_parameters"),
    ("zero row", "not finite"),
])
def test_bad_dora_adapters_are_refused_by_name(tiny, tmp_path, case, match):
    d, _ = tiny
    src = d / "adapters" / "dora-qv"
    edits = {
        "missing": dict(edit_weights=lambda w: {k: v for k, v in w.items() if k != _first_magnitude(w)}),
        "shape": dict(edit_weights=lambda w: {**w, _first_magnitude(w): w[_first_magnitude(w)][:-1].clone()}),
        "not dora": dict(edit_config=lambda c: {**c, "use_dora": False}),
        "experts": dict(edit_config=lambda c: {**c, "target_parameters": ["experts.down_proj"]}),
        "zero row": dict(edit_weights=lambda w: {k: (v.zero_() if "q_proj" in k and "layers.0." in k
                                                     and "magnitude" not in k else v) for k, v in w.items()}),
    }
    bad = _copy_adapter(src, tmp_path / "bad", **edits[case])
    llm = engine(d, names=["dora-qv"])
    if case == "zero row":       # a zero row of W + s B A shows only when its weights are read: the load fails
        _zero_base_row(llm)
        llm.register_adapter("bad", str(bad))
        failed, fine = llm.generate([PROMPTS[0]] * 2, GREEDY, adapter=["bad", "dora-qv"])
        assert failed.finish_reason == "abort" and match in failed.error and "layers.0.self_attn.q_proj" in failed.error
        assert fine.error is None and fine.token_ids
    else:
        with pytest.raises(ValueError, match=match):
            llm.register_adapter("bad", str(bad))
    assert llm.generate([PROMPTS[0]], GREEDY, adapter="dora-qv")[0].token_ids    # the engine serves on


def _zero_base_row(llm):
    """Row 0 of layer 0's q_proj made zero in the engine's base weights (with B A zero there: a zero row)."""
    llm.engine.runner.base_weight(0, "q_proj")[0].zero_()
