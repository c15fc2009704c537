"""Cache tensors from `zeroed` (worker/engine/zeroed.py) read as zeros in every size and
dtype (the attention's length masks rely on it: a masked slot must not hold NaN), take
writes like any tensor, and a KV cache made after a freed one of the same size is zeros
again (calloc never hands back the old bytes)."""

from __future__ import annotations

import pytest
import torch

from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.zeroed import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5), (64, 2, 16, 2, 64), (1024, 1024, 17)])
def test_zeroed_is_zeros_of_the_shape_and_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = zeroed(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[-1] = 1.5
    assert t[-1].eq(1.5).all() and not t[:-1].any()


def test_a_kv_cache_after_a_dirty_one_is_zeros() -> None:
    def cache() -> KVCache:
        return KVCache(num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float32, device="cpu")

    first = cache()
    first.tensor.fill_(float("nan"))
    del first
    assert not cache().tensor.any()
