"""The block hash chain of automatic prefix caching, shared by router and worker.

A full KV block (`block_size` tokens) is named by a hash of its parent block's hash, its
token ids and, where an image or video placeholder run overlaps it, the item's content hash
and where the run starts relative to the block (vLLM v1's "extra keys" of
`hash_block_tokens`). Chaining makes a block's hash name the whole prefix up to its end, so
two prompts share a block only if everything before it is the same too; mixing the
content hash in means that the same text around a different image never shares (the
placeholder token ids are identical, the KV is not).

The hash is stable across processes (blake2b over little-endian packed ids, no Python
`hash()`): the router computes the same chain over the prompts it tokenizes to route a
request to the instance that holds its prefix (router/prefix_index.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

BlockHash = bytes

_ROOT: BlockHash = b"triptych-prefix-v1"


class PlaceholderRun(Protocol):
    """An image/video placeholder run (`processor.MMItem`, `stage_protocol.MMItemSpec`, ...)."""

    offset: int
    length: int
    content_hash: str


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: Sequence[str] = ()) -> BlockHash:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra:
        h.update(b"\x00" + key.encode())
    return h.digest()


def extend_chain(chain: list[BlockHash], token_ids: Sequence[int], mm_items: Sequence[PlaceholderRun],
                 block_size: int, num_tokens: int | None = None) -> list[BlockHash]:
    """Append to `chain` the hashes of every full block of `token_ids[:num_tokens]` it lacks
    (it is extended in place as a request's tokens grow, and returned)."""
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for i in range(len(chain), n // block_size):
        start, end = i * block_size, (i + 1) * block_size
        extra = [f"{it.content_hash}@{it.offset - start}" for it in mm_items
                 if it.offset < end and it.offset + it.length > start]
        chain.append(hash_block(chain[-1] if chain else None, token_ids[start:end], extra))
    return chain


def block_hashes(token_ids: Sequence[int], mm_items: Sequence[PlaceholderRun], block_size: int,
                 num_tokens: int | None = None) -> list[BlockHash]:
    """The chain of the full blocks of `token_ids[:num_tokens]`."""
    return extend_chain([], token_ids, mm_items, block_size, num_tokens)
