"""The decode batch's gathered context, kept from one step to the next (torch backend).

Batched decode attention reads each sequence's K/V as one padded `[B, L]` tensor,
gathered block by block from the paged cache. A steady decode batch (the same sequences,
each one token longer than last step: most steps of serving) would gather the same
blocks again every step and layer - a copy of the whole batch's context, as large as
what the attention itself reads. Instead the gathered tensors stay, one per layer, and a
continuing step only writes its one new K/V row per sequence into them (vLLM's
"persistent batch" idea, applied to the gathered context). A step that does not continue
the last one and had nothing kept to build on gathers as usual and keeps nothing; the
second steady step in a row gathers into the kept layout (again when a row outgrows the
kept width), the ones after only append.

When rows leave or join but every row still fits the kept width, the rows that continue
are copied from the kept buffer into a second one (two per layer, used in turns) and only
the others are gathered: a long-tailed load changes its batch every few steps.

Safety rule: what was kept is valid only for the very next `plan()`; every plan either
continues it or starts over, so blocks freed and reused by another request in between
are never read from a stale copy. The paged cache stays the source of truth (prefill,
migration and prefix caching never see this copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# One layer's kept K+V may take this much memory (in each of its two buffers); a bigger
# batch gathers each step as before (the copy would cost more memory than it saves time).
MAX_BYTES_PER_LAYER = 64 << 20


@dataclass
class _Rows:
    tables: list[list[int]]  # each row's blocks holding its kv_len tokens
    kv_lens: list[int]
    width_blocks: int  # kept blocks per row (>= every row's blocks: room to grow); 0: not kept


@dataclass
class _Moves:
    """How a reshuffled step's rows come about: `kept` rows copied from last step's kept
    rows `source` (same positions), `fresh` rows gathered from the paged cache."""

    kept: torch.Tensor  # [n] this step's rows that continue one of last step's
    source: torch.Tensor  # [n] the last step's row each continues
    fresh: list[int]  # this step's rows that do not (joined, or their blocks changed)
    prev_batch: int
    prev_length: int  # last step's kept positions per row (this step's may be more)


@dataclass
class KeptContext:
    block_size: int = 0
    rows: _Rows | None = None
    generation: int = 0  # plan() count; a layer's buffer is current if stamped with it
    continuing: bool = False
    moves: _Moves | None = None  # set when this step reshuffles last step's kept rows
    slot: int = 0  # which of two buffers per layer holds the kept rows (a reshuffle flips it)
    flat_blocks: torch.Tensor | None = None  # [B * width] the rows' blocks, padded with block 0
    new_pos: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, position) of each new token
    _storage: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, slot) -> flat
    _gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # 0 -> one regather's blocks
    _stamps: dict[int, tuple] = field(default_factory=dict)  # layer -> (generation, slot, cache ptr, shape)

    def reset(self) -> None:
        self.generation += 1
        self.rows = None
        self.continuing = False
        self.moves = None

    def plan(self, tables: list[list[int]], kv_lens: list[int], block_size: int, row_bytes: int,
             device: torch.device) -> bool:
        """Take this step's decode rows (all one group). False: gather as usual this step -
        the rows do not continue last step's (a batch that changes every few steps would
        pay a regather into the kept layout for nothing), or they are too big to keep.
        `row_bytes` is one row's K+V bytes per key position and layer."""
        self.generation += 1
        needed = [-(-n // block_size) for n in kv_lens]
        prev = self.rows if self.block_size == block_size else None
        source = _continued_rows(prev, tables, kv_lens, block_size)
        steady = prev is not None and len(prev.kv_lens) == len(kv_lens) and source == list(range(len(kv_lens)))
        fits = prev is not None and 0 < max(needed) <= prev.width_blocks
        self.block_size = block_size
        self.rows = _Rows([t[:n] for t, n in zip(tables, needed, strict=True)], list(kv_lens), 0)
        self.flat_blocks = None  # built by the first layer that gathers this step
        self.continuing = steady and fits
        self.moves = None
        reshuffle = prev is not None and prev.width_blocks and any(j is not None for j in source)
        if not (self.continuing or reshuffle or steady):
            return False
        # A new layout doubles the width (at least 4 blocks more): fewer, larger steps pay.
        width = prev.width_blocks if fits else max(needed) + max(4, max(needed))
        if len(kv_lens) * width * block_size * row_bytes > MAX_BYTES_PER_LAYER:
            return False
        if not self.continuing and reshuffle:
            # Rows left or joined (the churn of a long-tailed load), or one outgrew the width:
            # the rows that continue are copied from the kept buffer into the other one, the
            # others gathered. (A steady step with nothing kept gathers into the kept layout.)
            assert prev is not None
            kept = [i for i, j in enumerate(source) if j is not None]
            self.moves = _Moves(torch.tensor(kept, device=device),
                                torch.tensor([source[i] for i in kept], device=device),
                                [i for i, j in enumerate(source) if j is None], len(prev.kv_lens),
                                prev.width_blocks * block_size)
            self.slot ^= 1
        self.rows.width_blocks = width
        self.new_pos = (torch.arange(len(kv_lens), device=device),
                        torch.tensor(kv_lens, device=device) - 1)
        return True

    def context(self, kv_cache: torch.Tensor, layer: int, k_new: torch.Tensor,
                v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys `[B, Hkv, D, L]` (transposed) and values `[B, Hkv, L, D]` in
        `layer`, `L = width * block_size`, this step's included (already written to
        `kv_cache` by the caller). Head-major, so each (row, head) is one contiguous matrix,
        and the keys position-last so that q K^T streams along L: on one CPU thread that
        product ran 1.8x faster than over `[L, D]` keys (torch_backend.py), and both far
        faster than SDPA over the block-major gather's strided view."""
        assert self.rows is not None and self.new_pos is not None
        batch, length = len(self.rows.kv_lens), self.rows.width_blocks * self.block_size
        keys, values = self._views(kv_cache, layer, self.slot, batch, length)
        stamp = (kv_cache.data_ptr(), kv_cache.dtype)
        last = self._stamps.get(layer)
        moves = self.moves
        if self.continuing and last == (self.generation - 1, self.slot, *stamp, batch, length):
            self._append(keys, values, k_new, v_new)
        elif moves is not None and last == (self.generation - 1, self.slot ^ 1, *stamp, moves.prev_batch,
                                             moves.prev_length):
            old = moves.prev_length
            old_keys, old_values = self._views(kv_cache, layer, self.slot ^ 1, moves.prev_batch, old)
            if old < length:  # grown: the new positions hold zeros until written (the mask hides them)
                keys[..., old:].zero_()
                values[:, :, old:].zero_()
            keys[..., :old].index_copy_(0, moves.kept, old_keys.index_select(0, moves.source))
            values[:, :, :old].index_copy_(0, moves.kept, old_values.index_select(0, moves.source))
            if moves.fresh:
                self._gather(kv_cache, layer, keys, values, moves.fresh)
            self._append(keys, values, k_new, v_new)
        else:
            self._gather(kv_cache, layer, keys, values, list(range(batch)))
        self._stamps[layer] = (self.generation, self.slot, *stamp, batch, length)
        return keys, values

    def _views(self, kv_cache: torch.Tensor, layer: int, slot: int, batch: int,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv_heads, dim = kv_cache.shape[4:]
        half = batch * kv_heads * dim * length
        flat = self._buffer(self._storage, (layer, slot), (2 * half,), kv_cache)
        return flat[:half].view(batch, kv_heads, dim, length), flat[half:].view(batch, kv_heads, length, dim)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """This step's K/V row of every row, at its last position."""
        keys.permute(0, 3, 1, 2).index_put_(self.new_pos, k_new.to(keys.dtype))
        values.transpose(1, 2).index_put_(self.new_pos, v_new.to(values.dtype))

    def _gather(self, kv_cache: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor,
                rows: list[int]) -> None:
        """Rows `rows` from the paged cache (this step's token included), padded with block 0
        to the width (finite values; the mask hides them)."""
        assert self.rows is not None
        width, (kv_heads, dim) = self.rows.width_blocks, kv_cache.shape[4:]
        every = len(rows) == len(self.rows.tables)
        if self.flat_blocks is None or not every:
            flat_ids = [b for i in rows for t in (self.rows.tables[i],) for b in (*t, *([0] * (width - len(t))))]
            blocks = torch.tensor(flat_ids, dtype=torch.long, device=kv_cache.device)
            if every:
                self.flat_blocks = blocks
        else:
            blocks = self.flat_blocks
        tmp = self._buffer(self._gathered, 0, (blocks.numel(), self.block_size, kv_heads, dim), kv_cache)
        gathered = tmp.view(len(rows), width * self.block_size, kv_heads, dim)
        index = None if every else torch.tensor(rows, device=kv_cache.device)
        for part, out in ((0, keys), (1, values)):
            torch.index_select(kv_cache[:, layer, part], 0, blocks, out=tmp)
            laid_out = gathered.permute(0, 2, 3, 1) if part == 0 else gathered.transpose(1, 2)
            if index is None:
                out.copy_(laid_out)
            else:
                out.index_copy_(0, index, laid_out)

    @staticmethod
    def _buffer(stores: dict, key: object, shape: tuple[int, ...],
                kv_cache: torch.Tensor) -> torch.Tensor:
        # Grown, never shrunk: a fresh multi-MB tensor per regather would cost page faults.
        size = 1
        for n in shape:
            size *= n
        store = stores.get(key)
        if store is None or store.numel() < size or store.dtype != kv_cache.dtype or store.device != kv_cache.device:
            # Room for the next doubling of the width (up to the cap): the regather that
            # outgrows this one then copies into memory already paged in.
            room = max(size, min(2 * size, MAX_BYTES_PER_LAYER // kv_cache.element_size()))
            store = torch.empty(room, dtype=kv_cache.dtype, device=kv_cache.device)
            stores[key] = store
        return store[:size].view(shape)


def _continued_rows(prev: _Rows | None, tables: list[list[int]], kv_lens: list[int],
                    block_size: int) -> list[int | None]:
    """For each row, the row of last step's it continues (same blocks for its earlier
    tokens, one token longer), or None. Rows with equal keys hold equal K/V (the same
    blocks up to the same length: forked choices sharing a prompt), so either will do."""
    if prev is None:
        return [None] * len(kv_lens)
    index = {(tuple(t), n): j for j, (t, n) in enumerate(zip(prev.tables, prev.kv_lens, strict=True))}
    out: list[int | None] = []
    for table, n in zip(tables, kv_lens, strict=True):
        earlier = -(-(n - 1) // block_size)
        out.append(index.get((tuple(table[:earlier]), n - 1)))
    return out
