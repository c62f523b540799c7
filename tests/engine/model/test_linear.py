"""Pre-packed oneDNN weights give what F.linear gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import Linear, _can_pack


@pytest.mark.skipif(not _can_pack(torch.bfloat16), reason="no native bf16 oneDNN on this CPU")
@pytest.mark.parametrize("m", [1, 3, 64, 130, 2048])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (40, 24)])
def test_packed_equals_f_linear(m, out_f, in_f):
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, in_f, generator=g).to(torch.bfloat16)
    lin = Linear(w)
    assert lin.packed is not None
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-2, rtol=1e-2)
    assert lin(x[::2]).shape == (len(x[::2]), out_f)          # non-contiguous input


def test_float32_is_not_packed():
    w = torch.randn(8, 4)
    lin = Linear(w)
    assert lin.packed is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(x), x @ w.T)
