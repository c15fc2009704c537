"""Back a lazily zeroed cache tensor (KV or MM) with memory just ahead of its allocator, off the step.

A cache tensor from `zeroed()` gets its pages on first touch. The allocator hands out
never-used blocks in ascending order before it reuses any (the prefix cache keeps freed
blocks for hits), so for the first `nbytes` of traffic nearly every step writes into fresh
pages: a decode step of 32 rows (small Qwen2-VL, fp32, one thread) spent ~1.1 ms of its
~22 ms in those page faults, the KV writes ~170 us a layer against ~35 us into touched
memory. A daemon thread here asks the kernel to back the blocks ahead of the highest one
handed out (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+): it faults the pages in without
changing their contents, so it needs no lock and races with nothing, and it costs only
what the traffic would have touched anyway. Where the call is unavailable (older kernel,
not Linux) it is off, and the pages fault in as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python's mmap module does not export it
AHEAD_BYTES = 32 << 20  # how far ahead of the highest block handed out the pages are backed
PAGE = 4096


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Prefaulter:
    """Backs blocks `[0, upto)` of a block-major tensor of `num_blocks` blocks with memory;
    `ahead(block)` moves `upto` `AHEAD_BYTES` past `block`. The work runs on a short-lived
    thread per stretch (none stays behind), which holds no reference to the tensor: pages of
    a tensor freed meanwhile are refused (ENOMEM) or belong to another buffer, whose
    contents backing leaves as they are."""

    def __init__(self, tensor: torch.Tensor, num_blocks: int, ahead_bytes: int = AHEAD_BYTES) -> None:
        self._addr = tensor.data_ptr()
        self._block_bytes = tensor.numel() * tensor.element_size() // num_blocks
        self._num_blocks = num_blocks
        self._ahead = max(1, ahead_bytes // max(1, self._block_bytes))
        self._target = 0  # blocks [0, target) are to be backed
        self._done = 0  # blocks [0, done) are
        self._running = False
        self._lock = threading.Lock()
        self._madvise = _madvise() if tensor.device.type == "cpu" else None
        self.enabled = self._madvise is not None

    @property
    def backed_blocks(self) -> int:
        return self._done

    def ahead(self, block: int) -> None:
        """Blocks up to `block` were handed out: back the ones after it (a no-op while they are)."""
        if not self.enabled or block + self._ahead <= self._target or self._target >= self._num_blocks:
            return
        with self._lock:
            target = min(self._num_blocks, block + 2 * self._ahead)
            if target <= self._target:
                return  # near the end: every block is asked for already
            self._target = target
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="kv-prefault", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self.enabled or self._done >= self._target:
                    self._running = False
                    return
                start, end = self._done, self._target
            ok = self._populate(start, end)
            with self._lock:
                self._done = end if ok else self._done
                self.enabled = self.enabled and ok

    def _populate(self, start: int, end: int) -> bool:
        """madvise the pages of blocks [start, end); False if the kernel refuses."""
        assert self._madvise is not None
        lo = self._addr + start * self._block_bytes
        hi = self._addr + end * self._block_bytes
        lo -= lo % PAGE  # a neighbour's page: backing it changes nothing either
        if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:  # ctypes drops the GIL meanwhile
            log.info("MADV_POPULATE_WRITE refused (errno %d): KV pages fault in on first use",
                     ctypes.get_errno())
            return False
        return True
