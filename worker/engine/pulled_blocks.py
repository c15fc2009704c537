"""The engine's cache blocks for data pulled from another instance (serving / transfer).

A P->D hand-over's KV blocks, an E->P embedding's MM blocks: the migration service
reserves them, the transfer writes them, and the request that uses them takes them over
(`Request.prefilled`) or they are freed. Every call holds the engine's lock: the step
thread allocates from the same caches. A mixin of `Engine` (engine.py), which owns the
caches, the lock and the driver.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from triptych.prefix_hash import BlockHash, PlaceholderRun, block_hashes
from triptych.topology import InstanceType
from triptych.worker.engine.kv_cache import OutOfBlocksError
from triptych.worker.engine.mm_cache import MMEntry
from triptych.worker.engine.request import StageNotServedError

if TYPE_CHECKING:
    from triptych.worker.engine.driver import EngineDriver
    from triptych.worker.engine.kv_cache import KVCache
    from triptych.worker.engine.mm_cache import MMCache


class PulledBlocks:
    kv: KVCache | None
    mm: MMCache | None
    role: InstanceType
    driver: EngineDriver
    _lock: threading.RLock

    def _free_refused_blocks(self, block_ids: list[int]) -> None:
        if self.kv is None:
            return
        with self._lock:
            for block in block_ids:
                try:
                    self.kv.free([block])
                except ValueError:
                    pass  # not a block this engine handed out

    def reserve_kv(self, num_tokens: int) -> list[int]:
        """KV blocks for a prefilled KV cache to be written from elsewhere (then pass them in
        `Request.prefilled`; `free_kv` if the pull fails)."""
        if self.kv is None:
            raise StageNotServedError(f"this {self.role.value} instance holds no KV cache")
        with self._lock:
            return self.kv.allocate(self.kv.blocks_for(num_tokens))

    def kv_block_hashes(self, token_ids: Sequence[int], mm_items: Sequence[PlaceholderRun],
                        num_tokens: int) -> list[BlockHash]:
        """The prefix-cache names of the full blocks of `token_ids[:num_tokens]` (none
        without a prefix cache)."""
        if self.kv is None or self.kv.prefix is None:
            return []
        # In offset order, as a Request orders them: the chain must match its own prefills'.
        return block_hashes(token_ids, sorted(mm_items, key=lambda it: it.offset), self.kv.block_size, num_tokens)

    def reserve_kv_cached(self, num_tokens: int, hashes: list[BlockHash]) -> tuple[list[int], int]:
        """Like `reserve_kv`, but the leading blocks whose `hashes` this instance's prefix
        cache holds are taken by reference instead of fresh: (block ids, how many of the
        first ones already hold their KV — the rest must be written)."""
        if self.kv is None:
            raise StageNotServedError(f"this {self.role.value} instance holds no KV cache")
        with self._lock:
            held = self.kv.cached_prefix(hashes)
            self.kv.touch(held)
            try:
                fresh = self.kv.allocate(self.kv.blocks_for(num_tokens) - len(held))
            except OutOfBlocksError:
                self.kv.free(held)
                raise
        return held + fresh, len(held)

    def cache_kv(self, block_ids: list[int], hashes: list[BlockHash]) -> None:
        """Name written full blocks (`hashes[i]` for `block_ids[i]`) in the prefix cache, so
        a later hand-over of the same prefix finds them here."""
        if self.kv is None or self.kv.prefix is None:
            return
        with self._lock:
            for block, block_hash in zip(block_ids, hashes, strict=False):
                self.kv.register(block, block_hash)

    def fork_kv(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """New blocks holding a copy of the first `num_tokens` tokens' KV in `block_ids` (an
        n > 1 request's prompt, one copy per choice). The source blocks are not written
        while they are copied: they belong to a parked or not yet admitted request."""
        if self.kv is None:
            raise StageNotServedError(f"this {self.role.value} instance holds no KV cache")
        with self._lock:
            new = self.kv.allocate(self.kv.blocks_for(num_tokens))
        src = torch.tensor(block_ids[:len(new)], device=self.kv.tensor.device)
        dst = torch.tensor(new, device=self.kv.tensor.device)
        self.kv.tensor.index_copy_(0, dst, self.kv.tensor.index_select(0, src))
        return new

    def free_kv(self, block_ids: list[int]) -> None:
        assert self.kv is not None
        with self._lock:
            self.kv.free(block_ids)
        self.driver.wake()  # a request may be waiting for blocks

    def acquire_mm(self, content_hash: str) -> MMEntry | None:
        """A reference to a cached embedding (None if absent); `release_mm` it when done."""
        if self.mm is None:
            return None
        with self._lock:
            return self.mm.acquire(content_hash)

    def reserve_mm(self, content_hash: str, num_rows: int) -> MMEntry:
        """MM blocks for an embedding to be written from elsewhere; `commit_mm` when written,
        then `release_mm` (requests that use it hold their own references)."""
        if self.mm is None:
            raise StageNotServedError(f"this {self.role.value} instance holds no MM cache")
        with self._lock:
            return self.mm.allocate(content_hash, num_rows)

    def commit_mm(self, entry: MMEntry) -> None:
        with self._lock:
            assert self.mm is not None
            self.mm.commit(entry)
        self.driver.wake()  # a prefill may be waiting for this embedding

    def release_mm(self, entry: MMEntry) -> None:
        with self._lock:
            assert self.mm is not None
            self.mm.release(entry)
        self.driver.wake()  # an encode may be waiting for MM cache space

