"""Cache tensors from `zeroed` (worker/engine/zeroed.py) read as zeros in every size and
dtype (the attention's length masks rely on it: a masked slot must not hold NaN), take
writes like any tensor, and a KV cache made after a freed one of the same size is zeros
again (calloc never hands back the old bytes)."""

from __future__ import annotations

import time

import pytest
import torch

from triptych.worker.engine.kv_cache import KVCache
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.prefault import Prefaulter
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


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of `t` backed by memory now (mincore(2))."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = 4096
    start = t.data_ptr() - t.data_ptr() % page
    end = t.data_ptr() + t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * (-(-(end - start) // page)))()
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


def _wait_backed(pre: Prefaulter, blocks: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pre.backed_blocks < blocks and time.monotonic() < deadline:
        time.sleep(0.005)


def test_fresh_kv_blocks_are_backed_ahead_of_allocation_without_changing_them() -> None:
    """Allocating fresh blocks has the pages of the next ones backed in the background
    (MADV_POPULATE_WRITE): their first write faults nothing in the step. Backing changes no
    byte, so blocks already written keep their contents."""
    # 32 KiB a block, 128 MiB in all: over glibc's largest mmap threshold (32 MiB), so a
    # fresh mapping whatever this process freed before
    kv = KVCache(num_blocks=4096, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                 device="cpu")
    if not kv.prefault.enabled:
        pytest.skip("MADV_POPULATE_WRITE is unavailable here (Linux 5.14+)")
    block_pages = kv.bytes_per_block // 4096
    assert _resident_pages(kv.tensor) < block_pages  # lazily zeroed: nothing backed yet
    ids = kv.allocate(2)
    kv.tensor[ids[0]].fill_(3.0)  # written before its neighbours get backed
    _wait_backed(kv.prefault, 64)
    assert kv.prefault.backed_blocks >= 64  # AHEAD_BYTES past block 1, up to every block here
    assert _resident_pages(kv.tensor[:64]) >= 64 * block_pages
    assert kv.tensor[ids[0]].eq(3.0).all() and not kv.tensor[ids[1]:].any()


def test_fresh_mm_blocks_are_backed_ahead_of_allocation() -> None:
    """The MM cache (image embeddings, encoded here or pulled from an E instance) too."""
    mm = MMCache(num_blocks=2048, rows_per_block=16, hidden_size=1024, dtype=torch.float32,
                 device="cpu")  # 64 KiB a block, 128 MiB in all
    if not mm.prefault.enabled:
        pytest.skip("MADV_POPULATE_WRITE is unavailable here (Linux 5.14+)")
    block_pages = mm.tensor[0].numel() * 4 // 4096
    assert _resident_pages(mm.tensor) < block_pages
    entry = mm.allocate("h", 20)  # two blocks
    _wait_backed(mm.prefault, 64)
    assert mm.prefault.backed_blocks >= 64
    assert _resident_pages(mm.tensor[:64]) >= 64 * block_pages
    assert entry.block_ids == [0, 1] and not mm.tensor.any()


def test_without_the_call_blocks_fault_in_on_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from triptych.worker.engine import prefault

    monkeypatch.setattr(prefault, "_madvise", lambda: None)
    kv = KVCache(num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
                 device="cpu")
    assert not kv.prefault.enabled
    kv.allocate(8)
    kv.tensor.fill_(1.0)
    assert kv.prefault.backed_blocks == 0 and kv.tensor.eq(1.0).all()


def test_blocks_near_the_end_start_no_more_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every block is asked for, allocations (however high their ids, as when freed
    blocks come round again) start no thread: the allocator's path stays a comparison."""
    kv = KVCache(num_blocks=64, num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
                 device="cpu")  # 4 KiB a block: AHEAD_BYTES covers all of it
    if not kv.prefault.enabled:
        pytest.skip("MADV_POPULATE_WRITE is unavailable here (Linux 5.14+)")
    kv.allocate(1)
    _wait_backed(kv.prefault, 64)
    assert kv.prefault.backed_blocks == 64
    started: list[object] = []
    monkeypatch.setattr("triptych.worker.engine.prefault.threading.Thread",
                        lambda *a, **k: started.append(k) or pytest.fail("a thread was started"))
    kv.free(kv.allocate(63))
    kv.allocate(63)
    assert not started
