"""How many distinct adapters one step may hold: with max_loras unset, as many as the pool holds on every
backend (the CPU and Triton backends read adapters in place in the pool's pages; the reference backend's
slots grow), and max_loras on every backend where it is set; the tokens are the same either way."""
from __future__ import annotations

import pytest
import torch

from bench.adapters import write_peft_adapter
from bench.tiny_model import make_tiny_llama
from engine.config import ModelConfig
from engine.llm import LLM
from ipc.requests import GenerateRequest
from ipc.sampling_params import SamplingParams
from tests.kernels.backends import DEVICE, available_backends

N = 12                                     # more adapters than the slot count loraplex used to have (8)
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
needs_triton = pytest.mark.skipif("triton" not in available_backends(), reason="no Triton here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    d = tmp_path_factory.mktemp("distinct")
    make_tiny_llama(d / "model", model_dir, layers=1)
    cfg = ModelConfig.from_dir(d / "model", torch.float32, "tiny", None)
    for i in range(N):       # ranks 1..5, two target sets: mixed ranks and modules in one step
        targets = ("q_proj", "v_proj", "down_proj") if i % 2 else ("k_proj", "o_proj", "gate_proj", "up_proj")
        write_peft_adapter(d / "adapters" / f"a{i}", cfg, r=1 + i % 5, targets=targets, seed=i, std=0.3)
    return d


def run(d, backend: str, settle: bool = False, **kw) -> tuple[int, dict[str, list[int]], LLM]:
    """All N adapter requests at once, stepped by hand: (most distinct adapters running in a step, tokens).
    settle: every load in flight ends before each step (what fits in the pool is then resident, however
    fast the loader ran beside the steps)."""
    llm = LLM(model=str(d / "model"), dtype="float32", backend=backend, device=str(DEVICE), max_num_batched_tokens=256,
              block_size=16, **kw)
    core = llm.engine
    for i in range(N):                       # loaded before the requests come: the step, not the loader, decides
        llm.register_adapter(f"a{i}", str(d / "adapters" / f"a{i}"))
        core.prefetch_adapter(f"a{i}")
    core.adapters.wait_loads()
    for i in range(N):
        core.add_request(GenerateRequest(f"r{i}", [1, 20 + i, 300 + 7 * i, 5], PARAMS, adapter=f"a{i}"))
    peak, tokens = 0, {f"r{i}": [] for i in range(N)}
    while core.has_unfinished():
        if settle:
            core.adapters.wait_loads()
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        peak = max(peak, len(core.scheduler.admission.running))
    return peak, tokens, llm


@pytest.fixture(scope="module")
def oracle(tiny):
    """The reference backend, max_loras unset: the oracle tokens."""
    peak, tokens, llm = run(tiny, "torch")
    assert peak == N, "the reference backend's slots grow: all twelve adapters ran in the same steps"
    return tokens


def test_the_adapters_change_the_tokens(oracle):
    assert all(len(t) == PARAMS.max_tokens for t in oracle.values())
    assert len({tuple(t) for t in oracle.values()}) > N // 2


@pytest.mark.parametrize("backend", available_backends())
def test_every_backend_runs_every_adapter_in_one_step(tiny, oracle, backend):
    peak, tokens, llm = run(tiny, backend)
    assert llm.engine.slots.capacity is None
    assert peak == N, "no slot count: all twelve adapters ran in the same steps"
    assert tokens == oracle


@pytest.mark.parametrize("backend", available_backends())
def test_max_loras_caps_every_backend_when_set(tiny, oracle, backend):
    peak, tokens, _ = run(tiny, backend, max_loras=3)
    assert peak == 3
    assert tokens == oracle


@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "torch"])
def test_without_a_cap_the_pool_bounds_the_step(tiny, oracle, backend):
    """A pool with room for every request's KV but only a few adapters beside it: the step holds what fits,
    every request finishes, with the same tokens."""
    probe = LLM(model=str(tiny / "model"), dtype="float32", backend="torch", device=str(DEVICE), block_size=16,
                kv_cache_memory_bytes=1 << 20)
    page_bytes = (1 << 20) // probe.engine.pool.num_pages
    probe.register_adapter("a4", str(tiny / "adapters" / "a4"))           # rank 5, the largest
    adapter_pages = probe.engine.adapters.lookup("a4").layout.num_pages(probe.engine.adapters.page_elems)
    num_pages = N + 4 * adapter_pages          # one KV block per request (7 tokens) and about 4 adapters
    peak, tokens, llm = run(tiny, backend, settle=True, kv_cache_memory_bytes=num_pages * page_bytes)
    assert llm.engine.pool.num_pages == num_pages
    assert 2 <= peak < N
    assert tokens == oracle
