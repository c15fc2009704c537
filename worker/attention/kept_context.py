"""The decode batch's gathered context, kept from one step to the next (torch backend).

Batched decode attention reads each sequence's K/V as one padded `[B, L]` tensor,
gathered block by block from the paged cache. A steady decode batch (the same sequences,
each one token longer than last step: most steps of serving) would gather the same
blocks again every step and layer - a copy of the whole batch's context, as large as
what the attention itself reads. Instead the gathered tensors stay, one per layer, and a
continuing step only writes its one new K/V row per sequence into them (vLLM's
"persistent batch" idea, applied to the gathered context). A step that does not continue
the last one (a sequence joined or left, a block table changed) gathers as usual and
keeps nothing; the second steady step in a row gathers into the kept layout (again when
a row outgrows the kept width), the ones after only append.

Safety rule: what was kept is valid only for the very next `plan()`; every plan either
continues it or starts over, so blocks freed and reused by another request in between
are never read from a stale copy. The paged cache stays the source of truth (prefill,
migration and prefix caching never see this copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# One layer's kept K+V may take this much memory; a bigger batch gathers each step as
# before (the copy would cost more memory than it saves time).
MAX_BYTES_PER_LAYER = 64 << 20


@dataclass
class _Rows:
    tables: list[list[int]]  # each row's blocks holding its kv_len tokens
    kv_lens: list[int]
    width_blocks: int  # kept blocks per row (>= every row's blocks: room to grow); 0: not kept


@dataclass
class KeptContext:
    block_size: int = 0
    rows: _Rows | None = None
    generation: int = 0  # plan() count; a layer's buffer is current if stamped with it
    continuing: bool = False
    flat_blocks: torch.Tensor | None = None  # [B * width] the rows' blocks, padded with block 0
    new_pos: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, position) of each new token
    _storage: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> flat, grown as needed
    _gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # 0 -> one regather's blocks
    _stamps: dict[int, tuple] = field(default_factory=dict)  # layer -> (generation, cache ptr, shape)

    def reset(self) -> None:
        self.generation += 1
        self.rows = None
        self.continuing = False

    def plan(self, tables: list[list[int]], kv_lens: list[int], block_size: int, row_bytes: int,
             device: torch.device) -> bool:
        """Take this step's decode rows (all one group). False: gather as usual this step -
        the rows do not continue last step's (a batch that changes every few steps would
        pay a regather into the kept layout for nothing), or they are too big to keep.
        `row_bytes` is one row's K+V bytes per key position and layer."""
        self.generation += 1
        needed = [-(-n // block_size) for n in kv_lens]
        prev = self.rows
        steady = (
            prev is not None and self.block_size == block_size and len(prev.kv_lens) == len(kv_lens)
            and all(n == p + 1 for n, p in zip(kv_lens, prev.kv_lens, strict=True))
            and all(t[:len(pt)] == pt for t, pt in zip(tables, prev.tables, strict=True))
        )
        self.block_size = block_size
        self.rows = _Rows([t[:n] for t, n in zip(tables, needed, strict=True)], list(kv_lens), 0)
        self.flat_blocks = None  # built by the first layer that gathers this step
        self.continuing = steady and prev is not None and max(needed) <= prev.width_blocks
        if self.continuing:
            assert prev is not None
            width = prev.width_blocks
        elif steady:
            # Room to double (at least 4 blocks) before gathering afresh: each regather
            # relays out every row, so fewer, larger steps of the width pay.
            width = max(needed) + max(4, max(needed))
            if len(kv_lens) * width * block_size * row_bytes > MAX_BYTES_PER_LAYER:
                return False
        else:
            return False
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
        kv_heads, dim = kv_cache.shape[4:]
        half = batch * kv_heads * dim * length
        flat = self._buffer(self._storage, layer, (2 * half,), kv_cache)
        keys = flat[:half].view(batch, kv_heads, dim, length)
        values = flat[half:].view(batch, kv_heads, length, dim)
        stamp = (kv_cache.data_ptr(), kv_cache.dtype, keys.shape)
        if self.continuing and self._stamps.get(layer) == (self.generation - 1, *stamp):
            keys.permute(0, 3, 1, 2).index_put_(self.new_pos, k_new.to(flat.dtype))
            values.transpose(1, 2).index_put_(self.new_pos, v_new.to(flat.dtype))
        else:
            if self.flat_blocks is None:  # each row's blocks, padded with block 0 to the width
                width = self.rows.width_blocks
                flat_ids = [b for t in self.rows.tables for b in (*t, *([0] * (width - len(t))))]
                self.flat_blocks = torch.tensor(flat_ids, dtype=torch.long, device=kv_cache.device)
            blocks = (self.flat_blocks.numel(), self.block_size, kv_heads, dim)
            tmp = self._buffer(self._gathered, 0, blocks, kv_cache)
            torch.index_select(kv_cache[:, layer, 0], 0, self.flat_blocks, out=tmp)
            keys.copy_(tmp.view(batch, length, kv_heads, dim).permute(0, 2, 3, 1))
            torch.index_select(kv_cache[:, layer, 1], 0, self.flat_blocks, out=tmp)
            values.copy_(tmp.view(batch, length, kv_heads, dim).transpose(1, 2))
        self._stamps[layer] = (self.generation, *stamp)
        return keys, values

    @staticmethod
    def _buffer(stores: dict[int, torch.Tensor], key: int, shape: tuple[int, ...],
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
