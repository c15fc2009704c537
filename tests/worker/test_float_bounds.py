"""The fp32 bound used by the model tests scales with the tensor's magnitude."""

from __future__ import annotations

import pytest
import torch
from float_bounds import assert_close_fp32


def test_the_bound_scales_with_the_largest_value() -> None:
    logits = torch.tensor([16.0, -3.0, 0.01])
    assert_close_fp32(logits + torch.tensor([0.0, 0.0, 1.05e-5]), logits)  # the CI flake: within
    with pytest.raises(AssertionError, match="batched vs alone"):
        assert_close_fp32(logits + torch.tensor([0.0, 0.0, 1e-3]), logits, msg="batched vs alone")
    small = torch.tensor([1.0, -0.5])
    with pytest.raises(AssertionError):
        assert_close_fp32(small + 1e-4, small)
    with pytest.raises(AssertionError):
        assert_close_fp32(small, torch.zeros(3))
