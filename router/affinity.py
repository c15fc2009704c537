"""Embedding-cache affinity: which instance last encoded each image, by content hash.

That instance's MM cache likely still holds the embedding, so sending the image there
again costs a pull, not an encode (EPDServe's MM cache, routed to by image hash). An LRU
of bounded size: a stale entry only costs an encode.
"""

from __future__ import annotations

from collections import OrderedDict

from triptych.router.registry import Instance, Registry
from triptych.topology import Stage


class AffinityIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def remember(self, content_hash: str, url: str) -> None:
        self._where[content_hash] = url
        self._where.move_to_end(content_hash)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def holder(self, content_hash: str, registry: Registry, excluded: set[str] | frozenset[str]
               ) -> Instance | None:
        """The instance to send the image to, if it is known and can still encode."""
        url = self._where.get(content_hash)
        if url is None or url in excluded:
            return None
        inst = registry.instances.get(url)
        return inst if inst is not None and inst.can_run(Stage.ENCODE) else None


class PrefixIndex:
    """KV prefix affinity: which instances likely hold each prompt block in their prefix
    cache, by block hash (`triptych.prefix_hash`, the chain the workers use).

    Learned from where this router sent prefills (llm-d's "approximate" prefix-cache
    scorer; Dynamo's KV router learns from the workers' block events instead). An LRU of
    bounded size over hashes: a stale entry (the instance evicted the block) only costs a
    prefill there, as without prefix routing.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, hashes: list[bytes], url: str) -> None:
        for h in hashes:
            self._where.setdefault(h, set()).add(url)
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def matched_blocks(self, hashes: list[bytes], url: str) -> int:
        """How many leading blocks of `hashes` `url` likely holds (a chain: a block is only
        useful if every block before it is held too)."""
        n = 0
        for h in hashes:
            if url not in self._where.get(h, ()):
                break
            n += 1
        return n

    def forget(self, url: str) -> None:
        """An instance that restarted or changed role holds none of its old blocks."""
        for urls in self._where.values():
            urls.discard(url)
