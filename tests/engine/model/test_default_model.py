"""The default model's conversion moving into the cache: two processes may convert it at once (make test's
workers on a fresh machine); the one that finishes second keeps the first's copy, which may be in use."""
from __future__ import annotations

from engine.model.default_model import _publish


def converted(d, tag: str):
    d.mkdir(parents=True)
    (d / "config.json").write_text(tag)
    (d / "model.safetensors").write_text(tag)
    return d


def test_a_conversion_moves_into_place(tmp_path):
    _publish(converted(tmp_path / "m.tmp1", "mine"), tmp_path / "m")
    assert (tmp_path / "m" / "config.json").read_text() == "mine" and not (tmp_path / "m.tmp1").exists()


def test_a_complete_copy_already_there_is_kept(tmp_path):
    converted(tmp_path / "m", "first")
    _publish(converted(tmp_path / "m.tmp2", "second"), tmp_path / "m")
    assert (tmp_path / "m" / "config.json").read_text() == "first" and not (tmp_path / "m.tmp2").exists()


def test_a_partial_copy_is_replaced(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("killed half way")
    _publish(converted(tmp_path / "m.tmp3", "whole"), tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_text() == "whole"
