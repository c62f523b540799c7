"""Everything loraplex cannot apply exactly is refused at registration, naming the field."""
import pytest
import torch

from engine.lora.host_adapter import load_host_adapter
from engine.lora.peft_config import read_spec
from tests.engine.lora.synthetic import TINY, write_adapter


@pytest.mark.parametrize("extra, field", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"r": 0}, "r must be"),
])
def test_unsupported_config_is_refused(tmp_path, extra, field):
    write_adapter(tmp_path, 4, config_extra=extra)
    with pytest.raises(ValueError, match=field):
        load_host_adapter(tmp_path, TINY, max_rank=64)


def test_pickled_weights_only_are_refused(tmp_path):
    write_adapter(tmp_path, 4)
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        load_host_adapter(tmp_path, TINY, max_rank=64)


def test_embedding_lora_weight_is_refused(tmp_path):
    write_adapter(tmp_path, 4, extra_tensors={
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="lm_head"):
        load_host_adapter(tmp_path, TINY, max_rank=64)


def test_shape_mismatch_and_rank_limit(tmp_path):
    write_adapter(tmp_path / "a", 4, config_extra={"r": 8})
    with pytest.raises(ValueError, match="different base architecture"):
        load_host_adapter(tmp_path / "a", TINY, max_rank=64)
    write_adapter(tmp_path / "b", 16)
    with pytest.raises(ValueError, match="max_lora_rank"):
        load_host_adapter(tmp_path / "b", TINY, max_rank=8)
    write_adapter(tmp_path / "c", 4, layers=3)
    with pytest.raises(ValueError, match="does not fit the base model"):
        load_host_adapter(tmp_path / "c", TINY, max_rank=64)


@pytest.mark.parametrize("tensor, match", [
    (torch.full((16, 4), float("nan")), "NaN or infinite"),
    (torch.full((16, 4), 1e39, dtype=torch.float64), "NaN or infinite"),     # finite in fp64, inf in fp32
    (torch.ones(16, 4, dtype=torch.int8), "floating point"),
])
def test_weights_that_cannot_give_numbers_are_refused(tmp_path, tensor, match):
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    write_adapter(tmp_path, 4, extra_tensors={key: tensor})
    with pytest.raises(ValueError, match=f"layers.1.self_attn.v_proj.lora_B.*{match}"):
        load_host_adapter(tmp_path, TINY, max_rank=64)


def test_missing_target_weights_are_refused(tmp_path):
    write_adapter(tmp_path, 4, targets=("q_proj",), config_extra={"target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(ValueError, match="v_proj"):
        load_host_adapter(tmp_path, TINY, max_rank=64)


def test_rslora_rank_and_alpha_patterns_set_scale(tmp_path):
    write_adapter(tmp_path, 4, config_extra={"use_rslora": True, "lora_alpha": 8,
                                             "alpha_pattern": {"v_proj": 2}})
    spec = read_spec(tmp_path)
    host = load_host_adapter(tmp_path, TINY, max_rank=64, spec=spec)
    assert host.modules[(0, "q_proj")].scale == pytest.approx(8 / 2)
    assert host.modules[(1, "v_proj")].scale == pytest.approx(2 / 2)
