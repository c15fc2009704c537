"""The attention interface between the language model and a backend.

One forward step carries a batch of sequences, each contributing `query_lens[i]` new
tokens (a prefill chunk, or 1 for a decode) laid out back to back. Their K/V are written
into the paged KV cache at `slot_mapping`, then each sequence's queries attend to its
first `kv_lens[i]` cached tokens: causally among the new tokens, fully over the earlier
context.

KV cache layout: `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`
(block-major: one block of one request is one contiguous region, so one transfer
descriptor moves a block across all layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    cu_query_lens: torch.Tensor  # [B+1] int32, prefix sums of query_lens
    kv_lens: torch.Tensor  # [B] int32, tokens in cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_size: int
    # Host copies, so backends never sync the device to learn the batch shape.
    kv_lens_list: list[int] = field(default_factory=list)
    block_tables_list: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass(frozen=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata, geometry: AttentionGeometry) -> None:
        """Prepare for one forward step (called once, before the first layer)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k/v at meta.slot_mapping in `layer`, attend, return `[T, num_heads, head_dim]`."""


class AttentionMetadataError(ValueError):
    """Inconsistent batch description (lengths, block tables)."""


def build_metadata(
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the step's metadata from per-sequence lengths and block tables.

    `kv_lens[i]` counts the tokens in sequence i's cache after this step (earlier context
    plus the `query_lens[i]` new ones); the new tokens occupy cache positions
    `kv_lens[i] - query_lens[i] .. kv_lens[i] - 1`.
    """
    _validate(query_lens, kv_lens, block_tables, block_size)
    slots: list[int] = []
    for q_len, kv_len, table in zip(query_lens, kv_lens, block_tables, strict=True):
        for pos in range(kv_len - q_len, kv_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(t) for t in block_tables), default=0) or 1
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        query_lens=list(query_lens),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(list(kv_lens), dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
        kv_lens_list=list(kv_lens),
        block_tables_list=[list(t) for t in block_tables],
    )


def _validate(
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> None:
    if block_size < 1:
        raise AttentionMetadataError(f"block_size must be >= 1, got {block_size}")
    if not (len(query_lens) == len(kv_lens) == len(block_tables)):
        raise AttentionMetadataError(
            f"batch size mismatch: {len(query_lens)} query_lens, {len(kv_lens)} kv_lens, "
            f"{len(block_tables)} block tables"
        )
    for i, (q_len, kv_len, table) in enumerate(zip(query_lens, kv_lens, block_tables, strict=True)):
        if q_len < 1 or kv_len < q_len:
            raise AttentionMetadataError(
                f"sequence {i}: need 1 <= query_len <= kv_len, got {q_len}, {kv_len}"
            )
        if len(table) * block_size < kv_len:
            raise AttentionMetadataError(
                f"sequence {i}: {len(table)} blocks of {block_size} cannot hold {kv_len} tokens"
            )


def slot_indices(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of each new token's cache slot."""
    return meta.slot_mapping // meta.block_size, meta.slot_mapping % meta.block_size


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Store the step's new K/V `[T, kv_heads, head_dim]` into `layer` of the paged cache."""
    blocks, offsets = slots
    kv_cache[blocks, layer, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, offsets] = v.to(kv_cache.dtype)
