"""Paged KV cache: one preallocated tensor plus a block allocator.

Layout `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (block-major):
one block of one request is one contiguous region, so the transfer layer registers the
tensor once with NIXL and moves a request's KV as one descriptor per block. The tensor is
never reallocated. A request's blocks need not be contiguous or ordered.

Blocks are reference-counted: with prefix caching (prefix_cache.py) several requests read
the same cached prefix blocks, and a block goes back to the free list (or, if it is
cached, to the prefix cache's LRU of evictable blocks) when its last reference goes.
`num_used` counts referenced blocks; cached blocks nobody references count as free.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import torch

from triptych.prefix_hash import BlockHash
from triptych.worker.engine.prefault import Prefaulter
from triptych.worker.engine.prefix_cache import PrefixCache
from triptych.worker.engine.zeroed import zeroed


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
                 shuffle_seed: int | None = None, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.tensor = zeroed((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype, device)
        self.allocator = BlockAllocator(num_blocks, shuffle_seed)  # blocks holding no cached prefix
        self.prefault = Prefaulter(self.tensor, num_blocks)  # fresh blocks' pages, ahead of use
        self.prefix: PrefixCache | None = PrefixCache() if prefix_caching else None
        self._refs: dict[int, int] = {}  # referenced blocks -> number of references

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: never-cached ones plus unreferenced cached ones."""
        return self.allocator.num_free + (self.prefix.num_evictable if self.prefix is not None else 0)

    @property
    def num_used(self) -> int:
        """Blocks some request or lease holds a reference to."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return self.prefix.num_cached if self.prefix is not None else 0

    @property
    def num_evicted(self) -> int:
        """Cached blocks given to new allocations so far (their prefix forgotten)."""
        return self.prefix.num_evicted if self.prefix is not None else 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def stats(self) -> dict[str, Any]:
        """`/admin/stats` `kv_cache`. used: referenced by a request or lease; free includes
        cached blocks nobody references (evictable), counted again in cached."""
        return {"num_blocks": self.num_blocks, "used": self.num_used, "free": self.num_free,
                "cached": self.num_cached, "evicted": self.num_evicted, "block_size": self.block_size,
                "bytes": self.nbytes, "prefix_caching": self.prefix is not None}

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with one reference each: never-cached blocks first, then the least
        recently freed cached ones (evicted: their prefix is forgotten)."""
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        fresh = min(n, self.allocator.num_free)
        ids = self.allocator.allocate(fresh)
        if ids:
            self.prefault.ahead(max(ids))
        while len(ids) < n:
            assert self.prefix is not None
            ids.append(self.prefix.evict())
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block. The tail goes first, so that of a request's
        cached blocks its last ones are evicted before its first (shared) ones."""
        for i in ids:
            if i not in self._refs:
                raise ValueError(f"block {i} is not allocated (double free?)")
        for i in reversed(ids):
            self._refs[i] -= 1
            if self._refs[i] > 0:
                continue
            del self._refs[i]
            if self.prefix is not None and self.prefix.is_cached(i):
                self.prefix.unreferenced(i)
            else:
                self.allocator.free([i])

    # --- prefix caching ------------------------------------------------------------------
    def cached_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Blocks already holding the longest run of `hashes` (no reference taken)."""
        return self.prefix.longest_prefix(hashes) if self.prefix is not None else []

    def touch(self, ids: list[int]) -> None:
        """Take a reference to each (cached) block."""
        for i in ids:
            if i in self._refs:
                self._refs[i] += 1
            else:
                assert self.prefix is not None and self.prefix.is_cached(i), f"block {i} is neither held nor cached"
                self.prefix.referenced(i)
                self._refs[i] = 1

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Name a full, computed block so later prompts can share it."""
        return self.prefix is not None and self.prefix.register(block, block_hash)
