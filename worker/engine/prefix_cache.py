"""Automatic prefix caching: which KV blocks hold which prefix, and which of them may go.

A full block computed here is registered under its hash (`triptych.prefix_hash`: a chain
over token ids and image content hashes). A later request whose prompt starts with the
same blocks takes references to them and computes only the rest (vLLM v1's
KVCacheManager, SGLang's RadixAttention; here a flat hash map as in vLLM).

Blocks are reference-counted by KVCache (kv_cache.py). A cached block nobody references
stays cached and counts as free: it sits in an LRU here and is evicted (its hash dropped)
only when an allocation finds no never-cached block left. A block referenced by a request
or a lease (a parked hand-off being pulled) is never in the LRU, so it is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from triptych.prefix_hash import BlockHash


class PrefixCache:
    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # Cached blocks with no reference, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evicted = 0

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def longest_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Blocks holding the longest run of `hashes` from the first; they stay where they
        are (the caller takes references with `KVCache.touch`)."""
        out: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Name a freshly filled block. A hash already cached elsewhere (two requests
        computed the same prefix at once) leaves `block` uncached; False then."""
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def unreferenced(self, block: int) -> None:
        """A cached block's last reference went: it may be evicted from now on."""
        self._evictable[block] = None

    def referenced(self, block: int) -> None:
        """A cached block is in use again: it must not be evicted."""
        self._evictable.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently freed unreferenced block and hand it out for reuse."""
        block, _ = self._evictable.popitem(last=False)
        self.num_evicted += 1
        del self._by_hash[self._hash_of.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forget every unreferenced cached block; returns them (now plain free blocks)."""
        blocks = list(self._evictable)
        for block in blocks:
            del self._by_hash[self._hash_of.pop(block)]
        self._evictable.clear()
        return blocks
