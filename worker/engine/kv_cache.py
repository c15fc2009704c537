"""Paged KV cache: one preallocated tensor plus a block allocator.

Layout `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (block-major):
one block of one request is one contiguous region, so the transfer layer registers the
tensor once with NIXL and moves a request's KV as one descriptor per block. The tensor is
never reallocated. A request's blocks need not be contiguous or ordered.
"""

from __future__ import annotations

import random
from collections import deque

import torch


class OutOfBlocksError(RuntimeError):
    """The allocator has fewer free blocks than asked for."""


class BlockAllocator:
    """A free list of block ids. `shuffle_seed` scrambles the initial order so tests see
    non-contiguous, non-monotonic block tables."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        ids = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(ids)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"block {i} is not allocated (double free?)")
            self._used.remove(i)
            self._free.append(i)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCache:
    def __init__(self, *, num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: str | torch.device,
                 shuffle_seed: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.tensor = torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks, shuffle_seed)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def allocate(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def free(self, ids: list[int]) -> None:
        self.allocator.free(ids)
