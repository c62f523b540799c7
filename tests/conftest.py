"""Shared fixtures: the default model directory (converted once) and a Hugging Face oracle."""
from __future__ import annotations

import os

# No GPU here: Triton kernels run in the interpreter on CPU tensors (set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Mark `interpreter` the tests that run Triton kernels in its interpreter: the Triton backend's cases, the
    kernel tests and the compile check. Pure Python and single-threaded, with nothing timed, they are a third
    of the suite's time on 2 cores, so `make test` runs them on up to 4 cores at once (pytest-xdist) and the rest,
    which time things and start servers, one at a time."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    for item in items:
        params = getattr(item, "callspec", None)
        on_triton = params is not None and any(isinstance(v, str) and v == "triton" for v in params.params.values())
        path = item.nodeid.split("::")[0]
        if on_triton or path.startswith("tests/kernels/triton/") or path.endswith("test_triton_compile_check.py"):
            item.add_marker(pytest.mark.interpreter)


@pytest.fixture(autouse=True)
def _close_test_llms(monkeypatch):
    """Close every `LLM` a test (or its function-scoped fixtures) made, when it ends: otherwise its loader and
    digest threads live on with the object, and a digest left running hashes adapter files at full speed (the
    engine is idle) beside the tests that follow. LLMs of module- or session-scoped fixtures are set up before
    this fixture and are left to their own teardown."""
    from engine.llm import LLM
    made = []
    init = LLM.__init__

    def recorded(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", recorded)
    yield
    for llm in made:
        if hasattr(llm, "engine"):          # (its __init__ may have failed on bad arguments)
            llm.close()


@pytest.fixture(scope="session")
def model_dir():
    from engine.model.default_model import default_model_dir
    return default_model_dir()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(str(model_dir))


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy generate for one prompt, cut after the first EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def assert_pool_idle(llm) -> None:
    """After a test: every page of the pool is free again and no request is left."""
    pool = llm.engine.pool
    assert pool.num_free == pool.num_pages, pool.usage()
    assert sum(pool.ref_count) == 0
    assert not llm.engine.has_unfinished()


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory, hf_model):
    """Eight PEFT adapters on disk, and the PeftModel that holds them all (the oracle)."""
    from tests.peft_adapters import FIDELITY_ADAPTERS, make_adapters
    d = tmp_path_factory.mktemp("adapters")
    oracle = make_adapters(hf_model, d, FIDELITY_ADAPTERS)
    return d, oracle


@pytest.fixture(autouse=True)
def _pool_back_to_idle(request):
    """After every test that used an LLM: no request left and no KV block held (adapters may stay
    resident: they are cached, not leaked)."""
    yield
    from engine.llm import LLM
    for value in request.node.funcargs.values():
        if isinstance(value, LLM):
            usage = value.engine.pool.usage()
            assert usage["kv"] == 0, f"KV blocks leaked: {usage}"
            assert not value.engine.has_unfinished()
            assert sum(value.engine.pool.ref_count) == usage["adapter"]


def cli_in_process(capsys, *args) -> tuple[int, str, str]:
    """`loraplex ARGS` run by this process (frontends.cli.main, as the entry point calls it) -> (rc, stdout,
    stderr): the same code without a new interpreter's ~6 s of imports (tests/frontends/test_cli.py also runs
    the real process)."""
    from frontends.cli import main
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err
