"""`--host-tier-dtype int8` (engine/lora/int8_pages.py): host copies as int8 with a scale per 128 elements,
quantized when the copy is taken and dequantized on the way back into the pool, on both ways a copy is made
(the loader's packed rows; a copy out of the pages after an in-place load)."""
import pytest
import torch

from engine.config import EngineConfig, LoraConfig
from engine.lora.adapter_manager import AdapterManager, AdapterState
from engine.lora.host_tier import HostTier
from engine.lora.int8_pages import GROUP, Int8Pages
from engine.page_pool import PagePool
from tests.engine.lora.synthetic import TINY, write_adapter

PAGE = 512


def test_round_trip_error_is_within_half_a_step_of_each_group():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, PAGE, generator=g) * torch.logspace(-4, 0, PAGE)     # groups of very different sizes
    x[2, 100:300] = 0.0                                                     # gaps stay exact zeros
    q = Int8Pages.quantize(x)
    back = q.dequantize(torch.float32)
    step = (x.view(6, -1, GROUP).abs().amax(-1) / 127).repeat_interleave(GROUP, dim=1)
    assert ((back - x).abs() <= step / 2 + 1e-12).all()
    assert (back[2, 128:256] == 0).all()
    assert q.nbytes == x.numel() + x.numel() // GROUP * 4
    assert q.nbytes / x.to(torch.bfloat16).nbytes < 0.52             # about half of bf16's bytes
    odd = torch.randn(2, 100, generator=g)                           # pages not a multiple of 128: groups of 4
    q = Int8Pages.quantize(odd)
    assert q.group == 4 and (q.dequantize(torch.float32) - odd).abs().max() < 0.02


def test_twice_the_adapters_in_the_same_bytes():
    packed = torch.randn(8, PAGE).to(torch.bfloat16)
    budget = 10 * packed.nbytes
    full, small = HostTier(1000, budget), HostTier(1000, budget)
    for i in range(40):
        full.put(i, packed.clone())
        small.put(i, Int8Pages.quantize(packed))
    assert len(full) == 10 and len(small) == 19 and small.nbytes <= budget          # 1.94x


def manager(num_pages, packer=None, **cfg):
    pool = PagePool(num_pages)
    storage = torch.zeros(num_pages, PAGE)
    return AdapterManager(LoraConfig(host_tier_dtype="int8", **cfg), TINY, pool, storage, packer), pool


def reload_from_host(m, a) -> torch.Tensor:
    """Evict `a`, spoil the pool, load it again (from its host copy) -> its pages after."""
    assert m.evict_idle(1000) >= len(a.pages) and a.state == AdapterState.DISK
    m.storage.fill_(-1.0)
    hits = m.stats.host_hits
    assert m.start_load(a)
    m.wait_loads()
    assert not m.poll() and a.state == AdapterState.RESIDENT and m.stats.host_hits == hits + 1
    return m.storage[a.pages].clone()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    step = want.view(want.shape[0], -1, GROUP).abs().amax(-1).repeat_interleave(GROUP, dim=1) / 127
    return bool(((got - want).abs() <= step / 2 + 1e-12).all())


def test_a_load_from_an_int8_copy_is_the_adapter_within_the_rounding(tmp_path, monkeypatch):
    import engine.lora.loader as loader
    monkeypatch.setattr(loader, "packs_in_place", lambda *a: False)  # the torch path (a GPU's, fp16): copy at load
    m, _ = manager(64)
    a = m.register("a", write_adapter(tmp_path / "a", r=3, targets=("q_proj", "down_proj")))
    assert m.start_load(a)
    m.wait_loads()
    assert not m.poll()
    want = m.storage[a.pages].clone()
    assert isinstance(m.host[a.adapter_id], Int8Pages)                # quantized on the loader's thread
    got = reload_from_host(m, a)
    assert close(got, want) and not torch.equal(got, want)
    assert (got[want == 0] == 0).all()


def test_the_copy_after_an_in_place_load_is_int8_too(tmp_path):
    from kernels.cpu.lora_pack import GroupPacker, _fn
    if _fn() is None:
        pytest.skip("no C compiler here")
    m, _ = manager(64, GroupPacker(torch.float32))
    a = m.register("a", write_adapter(tmp_path / "a", r=4, targets=("q_proj", "v_proj", "down_proj")))
    assert m.start_load(a)
    m.wait_loads()
    assert not m.poll() and a.adapter_id not in m.host                 # packed in place: no copy yet
    want = m.storage[a.pages].clone()
    m.settle()
    assert isinstance(m.host[a.adapter_id], Int8Pages)
    assert close(reload_from_host(m, a), want)


def test_the_engine_flag_is_checked(model_dir):
    with pytest.raises(ValueError, match="host_tier_dtype must be one of auto, int8"):
        EngineConfig.create(model=str(model_dir), host_tier_dtype="fp4")
