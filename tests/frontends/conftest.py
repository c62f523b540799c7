import shutil

import pytest

from tests.frontends.server_fixture import Server

API_KEY = "test-key"


@pytest.fixture(scope="session")
def served_adapters(adapter_dir, tmp_path_factory):
    """A copy of three test adapters in their own directory, for --adapter-dir."""
    src, _ = adapter_dir
    d = tmp_path_factory.mktemp("served")
    for name in ("r4-qv", "r8-all", "r16-attn"):
        shutil.copytree(src / name, d / name)
    return d, src


@pytest.fixture(scope="session")
def server(served_adapters):
    d, src = served_adapters
    s = Server("--adapter-dir", str(d), "--frontends", "2", "--api-key", API_KEY, "--max-loras", "4",
               "--lora-roots", str(src))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def server_fp32(served_adapters):
    """For exact-output checks across batches: bf16 greedy text may change with what shares the batch
    (GEMM blocking), float32 text does not."""
    d, _ = served_adapters
    s = Server("--adapter-dir", str(d), "--frontends", "2", "--api-key", API_KEY, "--max-loras", "4",
               "--dtype", "float32")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def tiny_served(tmp_path_factory, model_dir):
    """A tiny random Llama (serving-stack tests: each step costs about a millisecond) and a folder of
    three adapters for it."""
    import torch

    from bench.adapters import write_peft_adapter
    from bench.tiny_model import make_tiny_llama
    from engine.config import ModelConfig
    d = tmp_path_factory.mktemp("tiny-served")
    model = make_tiny_llama(d / "model", model_dir, max_positions=2048)
    cfg = ModelConfig.from_dir(model, torch.float32)
    for i, r in enumerate((2, 5, 8)):
        write_peft_adapter(d / "adapters" / f"tiny-r{r}", cfg, r, ("q_proj", "v_proj"), seed=i, std=0.2)
    return model, d / "adapters"
