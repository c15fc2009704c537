"""Bounds for float tensors that the same maths produced in a different order.

fp32 keeps about 7 significant digits: a sum rounded in another order (another batch
shape, kernel, thread count, or transformers' modules instead of ours) differs by a few
units in the last place of the terms it added, so the difference scales with the
magnitude of the values, not with a fixed constant. An absolute bound of 1e-5 is ~100
units in the last place for values near 1 but ~1 for logits near 16, where the tiny
models' batched and single-sequence logits differed by 1.05e-5 (reduction order follows
the batch). Measured on the tiny checkpoints: differences up to ~8e-7 of the tensor's
largest value (logits and embeddings alike), so FP32_RTOL leaves a margin of about 10x.
Greedy-token parity stays exact elsewhere: these bounds are only for the floats.
"""

from __future__ import annotations

import torch

FP32_RTOL = 1e-5


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor, msg: str = "", *,
                      rtol: float = FP32_RTOL) -> None:
    """Elementwise |actual - expected| <= rtol * (|expected| + max |expected|).

    The absolute part scales with the tensor's largest value: a matmul's rounding error is
    relative to the magnitude of the products it sums, so a logit near 0 in a row of
    logits near 16 carries the error of its row, not of its own size."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale,
                               msg=lambda default: f"{msg}\n{default}\n(max |expected| = {scale:.4g})")
