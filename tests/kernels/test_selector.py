"""The backend selector refuses what cannot run, naming it."""
from __future__ import annotations

import pytest
import torch

from kernels.selector import check_dtype_runs_on, select_backend
from tests.engine.lora.synthetic import TINY


@pytest.mark.parametrize("capability, ok", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_bfloat16_needs_an_ampere_or_newer_gpu(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    check_dtype_runs_on(torch.device("cuda"), torch.float32)          # float32 runs anywhere
    if ok:
        check_dtype_runs_on(torch.device("cuda"), torch.bfloat16)
    else:
        with pytest.raises(ValueError, match=r"Tesla T4 has 7\.5: use --dtype float32"):
            check_dtype_runs_on(torch.device("cuda"), torch.bfloat16)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="backend: 'tpu' is not one of"):
        select_backend("tpu", TINY)
    with pytest.raises(ValueError, match="device: 'npu' is not one of"):
        select_backend("torch", TINY, "npu")
