"""The decode batch's gathered context, kept from one step to the next (torch backend).

Batched decode attention reads each sequence's K/V as one padded `[S, L]` tensor,
gathered block by block from the paged cache. A steady decode batch (the same sequences,
each one token longer than last step: most steps of serving) would gather the same
blocks again every step and layer - a copy of the whole batch's context, as large as
what the attention itself reads. Instead the gathered tensors stay, one per layer, and a
continuing step only writes its one new K/V row per sequence into them (vLLM's
"persistent batch" idea, applied to the gathered context). A step that does not continue
the last one and had nothing kept to build on gathers as usual and keeps nothing; the
second steady step in a row gathers into the kept layout, the ones after only append.

Each sequence keeps its *slot* (its row of the kept tensors) while it decodes, whatever
its place in the scheduler's batch: a sequence that finishes frees its slot without a
copy, and one that joins is gathered into a free slot - only its own blocks. A long-
tailed load changes its batch every few steps, and re-laying out every row on each change
(copying the whole context into a second buffer) took 13% of such a run's time. The
layout changes - every continuing row copied into the other of two buffers per layer -
only when a row outgrows the kept width (which then doubles), when more rows join than
slots are free, or when the free slots among those in use outnumber half the rows.
Attention runs over the slots up to the last one in use (joining rows take the lowest free
ones); a free slot among them holds a finished row's finite values, attends to one
position, and its output is dropped.

Safety rule: what was kept is valid only for the very next `plan()`; every plan either
continues it or starts over, and a slot whose sequence is not in this step's batch is
freed at once, so blocks freed and reused by another request in between are never read
from a stale copy. The paged cache stays the source of truth (prefill, migration and
prefix caching never see this copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# One layer's kept K+V may take this much memory (in each of its two buffers); a bigger
# batch gathers each step as before (the copy would cost more memory than it saves time).
MAX_BYTES_PER_LAYER = 64 << 20

# A row's identity across steps: the blocks holding its tokens and how many tokens.
_Key = tuple[tuple[int, ...], int]


@dataclass
class _Layout:
    slots: int  # rows of the kept tensors (some may be free)
    width_blocks: int  # kept blocks per slot (>= every row's blocks: room to grow)


@dataclass
class _Relayout:
    """This step's rows that continue one of last step's, copied from last step's kept
    tensors (the other buffer, `prev` layout) into their new slots."""

    kept: torch.Tensor  # [n] new slots of the rows that continue
    source: torch.Tensor  # [n] the slot each had last step
    prev: _Layout


@dataclass
class KeptContext:
    block_size: int = 0
    layout: _Layout | None = None  # None: nothing kept
    occupants: list[_Key | None] = field(default_factory=list)  # per slot: its row, as of this step
    row_slots: list[int] = field(default_factory=list)  # this step's rows' slots, in batch order
    slot_index: torch.Tensor | None = None  # row_slots as a tensor; None when rows are slots 0..S-1
    generation: int = 0  # plan() count; a layer's buffer is current if stamped with it
    continuing: bool = False  # this step appends to last step's kept tensors in place
    relayout: _Relayout | None = None  # set when this step copies into a new layout
    fresh: list[int] = field(default_factory=list)  # rows gathered from the paged cache this step
    buffer: int = 0  # which of two buffers per layer holds the kept rows (a relayout flips it)
    new_pos: tuple[torch.Tensor, torch.Tensor] | None = None  # (slot, position) of each new token
    _last: dict[_Key, int] = field(default_factory=dict)  # last step's rows when nothing is kept
    _blocks: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    _storage: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, buffer) -> flat
    _gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # 0 -> one gather's blocks
    _stamps: dict[int, tuple] = field(default_factory=dict)  # layer -> (generation, buffer, cache, layout)

    def reset(self) -> None:
        self.generation += 1
        self.layout = None
        self.occupants = []
        self._last = {}
        self.continuing = False
        self.relayout = None

    @property
    def used(self) -> int:
        """Slots 0..used-1 hold this step's rows (and some free ones between them)."""
        return max(self.row_slots) + 1

    @property
    def slot_lens(self) -> list[int]:
        """Each used slot's key positions this step; a free one attends to one (dropped)."""
        return [1 if key is None else key[1] for key in self.occupants[: self.used]]

    def plan(self, tables: list[list[int]], kv_lens: list[int], block_size: int, row_bytes: int,
             device: torch.device) -> bool:
        """Take this step's decode rows (all one group). False: gather as usual this step -
        nothing was kept and the rows do not continue last step's (a batch that changes
        every few steps would pay a gather into the kept layout for nothing), or they are
        too big to keep. `row_bytes` is one row's K+V bytes per key position and layer."""
        self.generation += 1
        needed = [-(-n // block_size) for n in kv_lens]
        keys: list[_Key] = [(tuple(t[:b]), n) for t, b, n in zip(tables, needed, kv_lens, strict=True)]
        before = self._previous_slots(block_size)
        source = _continued(before, tables, kv_lens, block_size)
        self.block_size, self._blocks = block_size, {}
        self.continuing, self.relayout = False, None
        layout = self.layout
        if layout is None:
            steady = bool(self._last) and len(self._last) == len(kv_lens) and None not in source
            self._last = {key: i for i, key in enumerate(keys)}
            if not steady or not self._start(len(kv_lens), max(needed), row_bytes):
                self.layout = None
                return False
            self._place(keys, list(range(len(kv_lens))), list(range(len(kv_lens))), device)
            return True
        if all(j is None for j in source):  # a whole new batch: start over
            self.reset()
            self._last = {key: i for i, key in enumerate(keys)}
            return False
        if max(needed) <= layout.width_blocks and len(kv_lens) <= layout.slots:
            # Joining rows take the lowest free slots, so the slots in use stay packed at
            # the front; attention runs over those up to the last one in use.
            taken = {j for j in source if j is not None}
            free = iter(s for s in range(layout.slots) if s not in taken)
            slots = [j if j is not None else next(free) for j in source]
            if max(slots) + 1 - len(slots) <= max(2, len(slots) // 2):  # holes: wasted attention
                self.continuing = True
                self._place(keys, slots, [i for i, j in enumerate(source) if j is None], device)
                return True
        return self._relayout(keys, source, needed, row_bytes, device)

    def _previous_slots(self, block_size: int) -> dict[_Key, int]:
        if self.block_size != block_size:
            return {}
        if self.layout is None:
            return dict(self._last)
        return {key: s for s, key in enumerate(self.occupants) if key is not None}

    def _start(self, rows: int, needed: int, row_bytes: int) -> bool:
        # A new layout doubles the width (at least 4 blocks more) and has room for half as
        # many rows again (at least 4): fewer, larger changes pay. Free slots past the last
        # one in use cost memory, not attention.
        for slots in (rows + max(4, rows // 2), rows):
            for width in (needed + max(4, needed), needed):
                if slots * width * self.block_size * row_bytes <= MAX_BYTES_PER_LAYER:
                    self.layout = _Layout(slots, width)
                    return True
        return False

    def _relayout(self, keys: list[_Key], source: list[int | None], needed: list[int], row_bytes: int,
                  device: torch.device) -> bool:
        prev = self.layout
        assert prev is not None
        if not self._start(len(keys), max(needed), row_bytes):
            self.reset()
            return False
        # The rows that continue first, in batch order, then the ones gathered.
        staying = [i for i, j in enumerate(source) if j is not None]
        joining = [i for i, j in enumerate(source) if j is None]
        slots = [0] * len(keys)
        for s, i in enumerate(staying + joining):
            slots[i] = s
        self.relayout = _Relayout(torch.tensor([slots[i] for i in staying], device=device),
                                  torch.tensor([source[i] for i in staying], device=device), prev)
        self.buffer ^= 1
        self._place(keys, slots, joining, device)
        return True

    def _place(self, keys: list[_Key], slots: list[int], fresh: list[int], device: torch.device) -> None:
        assert self.layout is not None
        self.occupants = [None] * self.layout.slots
        for key, s in zip(keys, slots, strict=True):
            self.occupants[s] = key
        self.row_slots, self.fresh = slots, fresh
        slot_tensor = torch.tensor(slots, device=device)
        self.slot_index = None if slots == list(range(len(slots))) else slot_tensor
        self.new_pos = (slot_tensor, torch.tensor([key[1] for key in keys], device=device) - 1)

    def context(self, kv_cache: torch.Tensor, layer: int, k_new: torch.Tensor,
                v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' keys `[S, Hkv, D, L]` (transposed) and values `[S, Hkv, L, D]` in
        `layer`, `L = width * block_size`, this step's included (already written to
        `kv_cache` by the caller). Head-major, so each (slot, head) is one contiguous matrix,
        and the keys position-last so that q K^T streams along L: on one CPU thread that
        product ran 1.8x faster than over `[L, D]` keys (torch_backend.py), and both far
        faster than SDPA over the block-major gather's strided view."""
        layout, moved = self.layout, self.relayout
        assert layout is not None and self.new_pos is not None
        length = layout.width_blocks * self.block_size
        keys, values = self._views(kv_cache, layer, self.buffer, layout.slots, length)
        stamp = (kv_cache.data_ptr(), kv_cache.dtype)
        last = self._stamps.get(layer)
        if self.continuing and last == (self.generation - 1, self.buffer, *stamp, layout.slots, length):
            self._gather(kv_cache, layer, keys, values, self.fresh)
            self._append(keys, values, k_new, v_new)
        elif moved is not None and last == (self.generation - 1, self.buffer ^ 1, *stamp, moved.prev.slots,
                                            moved.prev.width_blocks * self.block_size):
            old = moved.prev.width_blocks * self.block_size
            old_keys, old_values = self._views(kv_cache, layer, self.buffer ^ 1, moved.prev.slots, old)
            if old < length:  # grown: the new positions hold zeros until written (the mask hides them)
                keys[..., old:].zero_()
                values[:, :, old:].zero_()
            n = min(old, length)  # a narrower layout (fewer, shorter rows) still holds every row
            keys[..., :n].index_copy_(0, moved.kept, old_keys[..., :n].index_select(0, moved.source))
            values[:, :, :n].index_copy_(0, moved.kept, old_values[:, :, :n].index_select(0, moved.source))
            self._gather(kv_cache, layer, keys, values, self.fresh)
            self._append(keys, values, k_new, v_new)
        else:
            if len(self.row_slots) < self.used:  # free slots among them are read: keep them finite
                keys[: self.used].zero_()
                values[: self.used].zero_()
            self._gather(kv_cache, layer, keys, values, list(range(len(self.row_slots))))
        self._stamps[layer] = (self.generation, self.buffer, *stamp, layout.slots, length)
        return keys, values

    def _views(self, kv_cache: torch.Tensor, layer: int, buffer: int, slots: int,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv_heads, dim = kv_cache.shape[4:]
        half = slots * kv_heads * dim * length
        flat = self._buffer(self._storage, (layer, buffer), (2 * half,), kv_cache)
        return flat[:half].view(slots, kv_heads, dim, length), flat[half:].view(slots, kv_heads, length, dim)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """This step's K/V row of every row, at its last position in its slot."""
        keys.permute(0, 3, 1, 2).index_put_(self.new_pos, k_new.to(keys.dtype))
        values.transpose(1, 2).index_put_(self.new_pos, v_new.to(values.dtype))

    def _gather(self, kv_cache: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor,
                rows: list[int]) -> None:
        """Rows `rows` from the paged cache (this step's token included) into their slots,
        padded with block 0 to the width (finite values; the mask hides them)."""
        if not rows:
            return
        assert self.layout is not None
        width, (kv_heads, dim) = self.layout.width_blocks, kv_cache.shape[4:]
        blocks, index = self._rows_blocks(rows, width, kv_cache.device)
        tmp = self._buffer(self._gathered, 0, (blocks.numel(), self.block_size, kv_heads, dim), kv_cache)
        gathered = tmp.view(len(rows), width * self.block_size, kv_heads, dim)
        for part, out in ((0, keys), (1, values)):
            torch.index_select(kv_cache[:, layer, part], 0, blocks, out=tmp)
            laid_out = gathered.permute(0, 2, 3, 1) if part == 0 else gathered.transpose(1, 2)
            if index is None:
                out.copy_(laid_out)
            else:
                out.index_copy_(0, index, laid_out)

    def _rows_blocks(self, rows: list[int], width: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' blocks padded with block 0 to the width, and their slots (None: the
        rows fill the slots in order); built by the first layer, reused by the others."""
        name = "all" if len(rows) == len(self.row_slots) else "fresh"
        if name not in self._blocks:
            slots = [self.row_slots[i] for i in rows]
            tables = [key[0] for s in slots for key in (self.occupants[s],) if key is not None]
            flat = [b for t in tables for b in (*t, *([0] * (width - len(t))))]
            in_order = slots == list(range(self.layout.slots if self.layout else 0))
            index = None if in_order else torch.tensor(slots, device=device)
            self._blocks[name] = (torch.tensor(flat, dtype=torch.long, device=device), index)
        return self._blocks[name]

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


def _continued(before: dict[_Key, int], tables: list[list[int]], kv_lens: list[int],
               block_size: int) -> list[int | None]:
    """For each row, the slot (or last step's row) it continues - the same blocks for its
    earlier tokens, one token fewer - or None. Rows with equal keys hold equal K/V (the same
    blocks up to the same length: forked choices sharing a prompt): the first takes the
    slot, the others are gathered."""
    left = dict(before)
    out: list[int | None] = []
    for table, n in zip(tables, kv_lens, strict=True):
        earlier = -(-(n - 1) // block_size)
        out.append(left.pop((tuple(table[:earlier]), n - 1), None))
    return out
