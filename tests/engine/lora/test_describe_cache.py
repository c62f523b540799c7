"""describe_adapter looks up a header it has described before (adapters of one recipe share theirs) instead
of walking its tensors again, and the lookup never lets through what a walk would refuse: everything the
walk reads besides the header (the LoRA settings, the file's size, max_rank, the model) is part of the key."""
import dataclasses

import pytest

from engine.lora import host_adapter
from engine.lora.host_adapter import describe_adapter
from tests.engine.lora.synthetic import TINY, write_adapter

TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture
def walks(monkeypatch):
    """How many times describe_adapter walked a header (the cache starts empty)."""
    monkeypatch.setattr(host_adapter, "_DESCRIBED", type(host_adapter._DESCRIBED)())
    count = []
    real = host_adapter._describe
    monkeypatch.setattr(host_adapter, "_describe", lambda *a: count.append(1) or real(*a))
    return count


def tables(files):
    return (files.keys, files.where, files.shapes, files.rows, files.magnitudes, files.header_sha256)


def test_a_second_adapter_of_one_recipe_is_not_walked_and_gets_the_walks_tables(tmp_path, walks):
    a = write_adapter(tmp_path / "a", 4, TARGETS, seed=1)
    b = write_adapter(tmp_path / "b", 4, TARGETS, seed=2)        # other weights, the same header
    fa = describe_adapter(a, TINY, 64)
    fb = describe_adapter(b, TINY, 64)
    assert len(walks) == 1
    assert fb.path == b and fb.weights == b / "adapter_model.safetensors"
    host_adapter._DESCRIBED.clear()
    walked = describe_adapter(b, TINY, 64)
    assert len(walks) == 2
    assert tables(fb) == tables(walked) == tables(fa)
    fb.where.clear()                                             # each AdapterFiles owns its tables
    assert describe_adapter(a, TINY, 64).where == fa.where


def test_other_settings_with_the_same_header_are_walked_with_their_own_scale(tmp_path, walks):
    a = write_adapter(tmp_path / "a", 4, TARGETS)
    b = write_adapter(tmp_path / "b", 4, TARGETS, config_extra={"lora_alpha": 32})
    fa, fb = describe_adapter(a, TINY, 64), describe_adapter(b, TINY, 64)
    assert len(walks) == 2
    assert {s[3] for s in fa.shapes.values()} == {2.0} and {s[3] for s in fb.shapes.values()} == {8.0}


def test_what_a_walk_refuses_is_refused_after_the_header_was_described(tmp_path, walks):
    a = write_adapter(tmp_path / "a", 4, TARGETS)
    describe_adapter(a, TINY, 64)
    with pytest.raises(ValueError, match="max_lora_rank"):
        describe_adapter(a, TINY, 2)
    small = dataclasses.replace(TINY, num_layers=1)
    with pytest.raises(ValueError, match="does not fit the base model"):
        describe_adapter(a, small, 64)
    b = write_adapter(tmp_path / "b", 4, TARGETS)
    f = b / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-8])                          # the same header, a file too short for it
    with pytest.raises(ValueError, match="data_offsets"):
        describe_adapter(b, TINY, 64)
