"""Paged MM (embedding) cache: image embeddings keyed by content hash.

Layout `[num_blocks, rows_per_block, lm_hidden]`; an image's `num_rows` embedding rows
fill `ceil(num_rows / rows_per_block)` blocks, not necessarily contiguous (HydraInfer §5:
the image cache is a paged cache with the same management interface as the KV cache).

Entries are found by content hash, so a repeated image is encoded once, and the serving
layer can pull an entry from another instance into blocks it reserved here (`allocate`,
write over NIXL, `commit`). An entry with refcount 0 stays cached and is evicted
least-recently-used first when blocks run out. The tensor is never reallocated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from triptych.worker.engine.kv_cache import BlockAllocator, OutOfBlocksError, blocks_for
from triptych.worker.engine.prefault import Prefaulter
from triptych.worker.engine.zeroed import zeroed


@dataclass(eq=False)
class MMEntry:
    content_hash: str
    block_ids: list[int]
    num_rows: int
    ready: bool = False
    refcount: int = 0
    flat_index: torch.Tensor = field(repr=False, default_factory=lambda: torch.empty(0, dtype=torch.long))


class MMCache:
    def __init__(self, *, num_blocks: int, rows_per_block: int, hidden_size: int,
                 dtype: torch.dtype, device: str | torch.device, shuffle_seed: int | None = None) -> None:
        if num_blocks < 1 or rows_per_block < 1:
            raise ValueError(f"need num_blocks >= 1 and rows_per_block >= 1, got {num_blocks}, {rows_per_block}")
        self.rows_per_block = rows_per_block
        self.device = torch.device(device)
        self.tensor = zeroed((num_blocks, rows_per_block, hidden_size), dtype, device)
        self.allocator = BlockAllocator(num_blocks, shuffle_seed)
        self.prefault = Prefaulter(self.tensor, num_blocks)  # fresh blocks' pages, ahead of use (prefault.py)
        self._entries: OrderedDict[str, MMEntry] = OrderedDict()  # LRU order for eviction

    # --- occupancy --------------------------------------------------------------------
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
    def num_referenced(self) -> int:
        """Blocks of entries some request or hand-over still holds; the rest of `num_used`
        is cached embeddings kept for reuse, evicted on demand."""
        return sum(len(e.block_ids) for e in self._entries.values() if e.refcount > 0)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def stats(self) -> dict[str, Any]:
        """`/admin/stats` `mm_cache`."""
        return {"num_blocks": self.num_blocks, "used": self.num_used, "free": self.num_free,
                "referenced": self.num_referenced, "rows_per_block": self.rows_per_block,
                "entries": self.num_entries, "bytes": self.nbytes}

    def blocks_for(self, num_rows: int) -> int:
        return blocks_for(num_rows, self.rows_per_block)

    # --- entries ----------------------------------------------------------------------
    def get(self, content_hash: str) -> MMEntry | None:
        return self._entries.get(content_hash)

    def acquire(self, content_hash: str) -> MMEntry | None:
        entry = self._entries.get(content_hash)
        if entry is not None:
            entry.refcount += 1
            self._entries.move_to_end(content_hash)
        return entry

    def release(self, entry: MMEntry) -> None:
        if entry.refcount <= 0:
            raise ValueError(f"MM entry {entry.content_hash} released more often than acquired")
        entry.refcount -= 1
        # A never-committed entry nobody waits for holds garbage: drop it now.
        if entry.refcount == 0 and not entry.ready:
            self._drop(entry)

    def can_allocate(self, num_rows: int) -> bool:
        evictable = sum(len(e.block_ids) for e in self._entries.values() if e.refcount == 0)
        return self.blocks_for(num_rows) <= self.num_free + evictable

    def allocate(self, content_hash: str, num_rows: int) -> MMEntry:
        """Reserve blocks for an embedding (refcount 1, not ready). Evicts unreferenced
        entries, least recently used first, when the free list is short."""
        if content_hash in self._entries:
            raise ValueError(f"MM entry {content_hash} already exists")
        need = self.blocks_for(num_rows)
        if not self.can_allocate(num_rows):
            raise OutOfBlocksError(f"MM cache: {need} blocks needed, {self.num_free} free "
                                   f"of {self.num_blocks} (the rest in use)")
        while self.num_free < need:
            victim = next(e for e in self._entries.values() if e.refcount == 0)
            self._drop(victim)
        ids = self.allocator.allocate(need)
        if ids:
            self.prefault.ahead(max(ids))
        entry = MMEntry(content_hash, ids, num_rows, refcount=1,
                        flat_index=self._flat_index(ids, num_rows))
        self._entries[content_hash] = entry
        return entry

    def write(self, entry: MMEntry, rows: torch.Tensor) -> None:
        if rows.shape[0] != entry.num_rows:
            raise ValueError(f"MM entry {entry.content_hash}: {rows.shape[0]} rows, expected {entry.num_rows}")
        flat = self.tensor.view(-1, self.tensor.shape[-1])
        flat.index_copy_(0, entry.flat_index, rows.to(flat.dtype))

    def commit(self, entry: MMEntry) -> None:
        entry.ready = True

    def read(self, entry: MMEntry, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) of an entry's embedding, `[n, hidden]` (a copy)."""
        idx = entry.flat_index[start:end]
        return self.tensor.view(-1, self.tensor.shape[-1]).index_select(0, idx)

    def clear_unused(self) -> None:
        for entry in [e for e in self._entries.values() if e.refcount == 0]:
            self._drop(entry)

    # --- internals --------------------------------------------------------------------
    def _drop(self, entry: MMEntry) -> None:
        del self._entries[entry.content_hash]
        self.allocator.free(entry.block_ids)
        entry.block_ids = []
        entry.ready = False

    def _flat_index(self, ids: list[int], num_rows: int) -> torch.Tensor:
        rpb = self.rows_per_block
        rows = torch.arange(num_rows)
        blocks = torch.tensor(ids, dtype=torch.long)[rows // rpb]
        return (blocks * rpb + rows % rpb).to(self.device)
