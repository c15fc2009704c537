"""A registered buffer of video pixel patches, in blocks of `video_rows_per_block` rows.

Both ends of the V -> E hand-over hold one: the V instance writes each decoded GOP set's
patches into blocks it offers under a lease; the encode instance READs them into blocks of
its own buffer (the same layout: float32 `[blocks, rows_per_block, C*T*P*P]`), copies
the rows out and frees its blocks at once. The region is allocated once and registered
once with the transfer engine (HydraInfer §4.3: registered memory, pull-based READs).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from triptych.stage_protocol import video_rows_per_block

REGION = "video"


class VideoBufferFullError(RuntimeError):
    """Not enough free blocks for a GOP set's patches now (a 503: retry later or elsewhere)."""


class VideoBuffer:
    """Fixed-size block pool over one contiguous float32 tensor (thread-safe)."""

    def __init__(self, patch_dim: int, max_bytes: int) -> None:
        self.rows_per_block = video_rows_per_block(patch_dim)
        block_nbytes = self.rows_per_block * patch_dim * 4
        num_blocks = max(1, max_bytes // block_nbytes)
        # torch.empty: pages are committed as blocks are first written, not up front.
        self.tensor = torch.empty((num_blocks, self.rows_per_block, patch_dim), dtype=torch.float32)
        self.patch_dim = patch_dim
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.rows_per_block)

    def reserve(self, rows: int) -> list[int]:
        need = self.blocks_for(rows)
        with self._lock:
            if need > len(self._free):
                raise VideoBufferFullError(f"video buffer has {len(self._free)} free blocks, {need} needed "
                                           f"({rows} patch rows)")
            return [self._free.pop() for _ in range(need)]

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            self._free.extend(block_ids)

    def write(self, block_ids: list[int], rows: np.ndarray) -> None:
        """Copy `rows` [n, patch_dim] into the blocks, in order (the last one partly)."""
        flat = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        for i, b in enumerate(block_ids):
            chunk = flat[i * self.rows_per_block:(i + 1) * self.rows_per_block]
            self.tensor[b, :len(chunk)].copy_(chunk)

    def read(self, block_ids: list[int], rows: int) -> np.ndarray:
        """The first `rows` rows held in the blocks, in order, as a fresh array."""
        return self.tensor[block_ids].reshape(-1, self.patch_dim)[:rows].numpy().copy()
