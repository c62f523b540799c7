"""kernels.transfer: a step's index tensors packed into one buffer and back."""
from __future__ import annotations

import pytest
import torch

from kernels.transfer import pack, to_device, unpack


def test_pack_then_unpack_gives_back_every_tensor_with_its_shape_and_dtype():
    tensors = [torch.arange(6).view(2, 3), None, torch.tensor([[5, -1]], dtype=torch.int32),
               torch.tensor([True, False, True]), torch.empty(0, dtype=torch.long), torch.tensor(7)]
    back = unpack(pack(tensors), tensors)
    assert back[1] is None
    for got, want in zip(back, tensors):
        if want is not None:
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_on_the_cpu_nothing_is_copied():
    t = torch.arange(3)
    assert to_device([t, None], torch.device("cpu"))[0] is t


def test_weights_are_refused():
    with pytest.raises(AssertionError, match="index type"):
        pack([torch.ones(2)])
