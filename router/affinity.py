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
