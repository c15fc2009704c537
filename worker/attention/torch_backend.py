"""Reference attention over the paged KV cache in plain torch (CPU and GPU).

Decodes (one new token per sequence) are batched: the decoding sequences' blocks are
gathered into padded `[B, max_len]` tensors and attended once per group with a length
mask (SDPA; on CPU a steady group's kept context with two batched GEMMs); this is the hot
path of serving. Decode attention reads every key of every row, padding included, so rows of very different lengths (a long-tailed mix:
one 500-token answer among 40-token ones) are split into a few groups of similar
length (`decode_groups`) rather than all padded to the longest. Prefill chunks run one
SDPA per sequence over that sequence's gathered context.

On CPU with an fp32 or bf16 cache, decodes go to the C kernel of cpu_decode.py instead (each
row's real keys read in place: no gather, no padding, no groups), where it builds, and so
do chunks of up to `KERNEL_MAX_QUERY` tokens, one kernel row per query row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionGeometry, AttentionMetadata, slot_indices, write_kv
from .cpu_decode import PagedDecode, kernel_serves
from .kept_context import KeptContext

# What one more decode group costs (a gather, an SDPA call, a scatter of its rows per
# layer), in padded key positions of one row: a split pays when it drops more padding than
# this. Measured on CPU (a 32-row group at ~150 keys): ~0.1 ms of fixed work per layer
# against ~3 us per (row, key block of 16) gathered and attended.
GROUP_COST_KEYS = 512
MAX_DECODE_GROUPS = 4
# Chunks of at most this many query rows go to the CPU kernel row by row (each row reads its
# context once) rather than to one SDPA per sequence: a migrated decode's fed tokens, short
# prompts, a short suffix after a prefix-cache hit. One thread, 16 decodes beside 8 chunks,
# all layers (docs/benchmarks.md, 2026-12-02): tiny model, chunks of 3 at 120 keys 13.0 -> 1.5 ms, of 64
# 22.3 -> 11.1 ms; small model, fresh chunks of 64 61.1 -> 18.9 ms, of 128 114 -> 59 ms.
KERNEL_MAX_QUERY = 64


def decode_groups(kv_lens: list[int], block_size: int) -> list[list[int]]:
    """Split decode rows (indices into `kv_lens`) into groups of similar padded length.

    No split while padding all rows to the longest costs at most half of the real keys (or
    `GROUP_COST_KEYS`). Otherwise rows are sorted by length, longest first; a new group
    starts at a row when padding the rows left (this one and every shorter one) to the
    current group's length would cost more than `GROUP_COST_KEYS` per group: greedy, one
    pass, at most `MAX_DECODE_GROUPS`.
    Each group lists its rows in batch order; one group is every row, in order."""
    padded = [-(-n // block_size) * block_size for n in kv_lens]
    if not padded:
        return []
    # One group unless padding would be over half of the real work: a single group is what
    # keeps its gathered context across steps (kept_context.py), worth more than modest padding.
    waste = len(padded) * max(padded) - sum(padded)
    if waste <= max(GROUP_COST_KEYS, sum(padded) // 2):
        return [list(range(len(kv_lens)))]
    order = sorted(range(len(kv_lens)), key=lambda i: -padded[i])
    groups: list[list[int]] = [[]]
    width = padded[order[0]]
    for pos, i in enumerate(order):
        rest = len(order) - pos
        if groups[-1] and len(groups) < MAX_DECODE_GROUPS and (width - padded[i]) * rest > GROUP_COST_KEYS:
            groups.append([])
            width = padded[i]
        groups[-1].append(i)
    # Rows keep the batch's order within a group: a steady batch then gives the same row
    # order every step (sorted order would change as rows cross block boundaries), which
    # is what lets the kept context continue.
    return [sorted(g) for g in groups]


def _decode_attention_cpu(queries: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                          plan: _DecodePlan) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v as two batched GEMMs over the kept context's
    contiguous `[B, Hkv, D, L]` keys and `[B, Hkv, L, D]` values. A decode has only `group`
    query rows per KV head; SDPA's CPU flash kernel, tiled for long query blocks, took
    1338 us a layer on one thread where these two GEMMs took 770 (32 rows x 176 keys)."""
    if plan.additive is None:
        plan.additive = torch.zeros(plan.mask.shape, dtype=queries.dtype).masked_fill_(~plan.mask, float("-inf"))
    scores = torch.matmul(queries, keys_t).mul_(queries.shape[-1] ** -0.5).add_(plan.additive)
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def _length_mask(lens: list[int], width: int, device: torch.device) -> torch.Tensor:
    """`[B, 1, 1, width]` bool, True where row b's key position is below `lens[b]`."""
    lengths = torch.tensor(lens, device=device)
    return (torch.arange(width, device=device)[None, :] < lengths[:, None])[:, None, None, :]


@dataclass
class _DecodePlan:
    token_index: torch.Tensor | None  # rows of q in this group (None: all rows, in order)
    flat_blocks: torch.Tensor  # [Bd * nb] int64, each decode's first nb table entries
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] bool, True where the key exists (kept: one row per slot)
    kept: bool = False  # context from KeptContext (kept_context.py), not gathered here
    additive: torch.Tensor | None = None  # the mask as 0 / -inf (CPU path), built by the first layer


@dataclass
class _PrefillSeq:
    start: int  # first row of the sequence's new tokens in q
    end: int
    kv_len: int
    blocks: torch.Tensor  # [ceil(kv_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None when there is no earlier context


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decodes: list[_DecodePlan] = []
        self._prefills: list[_PrefillSeq] = []
        self._geometry: AttentionGeometry | None = None
        self._buffers: torch.Tensor | None = None  # [2, blocks, block_size, kv_heads, head_dim]
        self._kept = KeptContext()  # a steady decode batch's context, across steps
        self._paged: PagedDecode | None = None  # this step's decodes, by the CPU kernel

    def plan(self, meta: AttentionMetadata, geometry: AttentionGeometry) -> None:
        device = meta.slot_mapping.device
        self._geometry = geometry
        self._slots = slot_indices(meta)
        self._paged = None
        if kernel_serves(device, geometry.dtype, geometry.head_dim):
            self._plan_kernel(meta, device)
            return
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        self._prefills = [
            self._plan_prefill(meta, i, device) for i, n in enumerate(meta.query_lens) if n != 1
        ]
        groups = decode_groups([meta.kv_lens_list[i] for i in decode_rows], meta.block_size)
        self._decodes = [self._plan_decode(meta, [decode_rows[j] for j in g], device) for g in groups]
        # CPU only: there the gather is a large share of a decode step; on a GPU it is cheap,
        # and the copy would take memory outside the KV cache's budget.
        if len(self._decodes) == 1 and device.type == "cpu":
            rows = groups[0] if len(decode_rows) == meta.num_seqs else [decode_rows[j] for j in groups[0]]
            row_bytes = 2 * geometry.num_kv_heads * geometry.head_dim * geometry.dtype.itemsize
            plan = self._decodes[0]
            plan.kept = self._kept.plan([meta.block_tables_list[i] for i in rows],
                                        [meta.kv_lens_list[i] for i in rows], meta.block_size, row_bytes, device)
            if plan.kept:  # the mask in the kept context's slot order
                plan.mask = _length_mask(self._kept.slot_lens, plan.mask.shape[-1], device)
        else:
            self._kept.reset()

    def _plan_kernel(self, meta: AttentionMetadata, device: torch.device) -> None:
        """The CPU kernel takes every decode row, and each query row of a short chunk as a
        row of its own (query j of a chunk sees the cache up to its own position: a row of
        that length over the sequence's table), so no groups, padding or kept copy (cpu_decode.py).
        Longer chunks keep one SDPA per sequence."""
        self._decodes = []
        self._kept.reset()
        starts = meta.cu_query_lens.tolist()
        rows: list[int] = []
        seqs: list[int] = []
        lens: list[int] = []
        self._prefills = []
        for i, n in enumerate(meta.query_lens):
            if n > KERNEL_MAX_QUERY:
                self._prefills.append(self._plan_prefill(meta, i, device))
                continue
            first = meta.kv_lens_list[i] - n + 1  # the first query row's keys, itself included
            rows.extend(range(starts[i], starts[i] + n))
            seqs.extend([i] * n)
            lens.extend(range(first, first + n))
        if rows:
            self._paged = PagedDecode(rows, meta.block_tables[seqs], lens)

    @staticmethod
    def _plan_decode(meta: AttentionMetadata, rows: list[int], device: torch.device) -> _DecodePlan:
        bs = meta.block_size
        kv_lens = [meta.kv_lens_list[i] for i in rows]
        nb = max(-(-n // bs) for n in kv_lens)
        in_order = rows == list(range(meta.num_seqs))  # every row, as laid out in q
        tables = meta.block_tables[:, :nb] if in_order else meta.block_tables[rows, :nb]
        index = None
        if not in_order:
            # A decode's one query row is at its sequence's offset in the batch.
            starts = [0]
            for n in meta.query_lens[:-1]:
                starts.append(starts[-1] + n)
            index = torch.tensor([starts[i] for i in rows], device=device)
        return _DecodePlan(index, tables.reshape(-1).long(), _length_mask(kv_lens, nb * bs, device))

    @staticmethod
    def _plan_prefill(meta: AttentionMetadata, i: int, device: torch.device) -> _PrefillSeq:
        bs = meta.block_size
        q_len, kv_len = meta.query_lens[i], meta.kv_lens_list[i]
        start = sum(meta.query_lens[:i])
        blocks = torch.tensor(meta.block_tables_list[i][: -(-kv_len // bs)], dtype=torch.long, device=device)
        mask = None
        if kv_len != q_len:
            # Query j sits at cache position kv_len - q_len + j and sees keys 0..that position.
            keys = torch.arange(kv_len, device=device)[None, :]
            limit = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
            mask = keys <= limit
        return _PrefillSeq(start, start + q_len, kv_len, blocks, mask)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self._slots is None or self._geometry is None:
            raise RuntimeError("TorchAttention.plan() must be called before forward()")
        write_kv(kv_cache, layer, k, v, self._slots)
        if len(self._decodes) == 1 and self._decodes[0].token_index is None:
            return self._decode_batch(q, k, v, kv_cache, layer, self._decodes[0])
        out = torch.empty_like(q)
        if self._paged is not None:  # then there are no decode groups
            self._paged(q, kv_cache, layer, out, self._geometry.num_kv_heads)
        for plan in self._decodes:
            assert plan.token_index is not None
            idx = plan.token_index
            rows = self._decode_batch(q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx),
                                      kv_cache, layer, plan)
            out.index_copy_(0, idx, rows)
        for seq in self._prefills:
            out[seq.start : seq.end] = self._prefill_one(q[seq.start : seq.end], kv_cache, layer, seq)
        return out

    def _decode_batch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
        plan: _DecodePlan,
    ) -> torch.Tensor:
        geo = self._geometry
        assert geo is not None
        batch = q.shape[0]
        group = geo.num_heads // geo.num_kv_heads
        # GQA without repeating K/V: the `group` query heads sharing a KV head become
        # that head's query rows (head h uses KV head h // group, as in transformers).
        queries = q.reshape(batch, geo.num_kv_heads, group, geo.head_dim)
        if plan.kept:  # CPU only (kept_context.py): rows attend in their slots
            length = plan.mask.shape[-1]
            keys_t, values = self._kept.context(kv_cache, layer, k, v)
            slots, used = self._kept.slot_index, plan.mask.shape[0]
            queries = queries.to(values.dtype)
            if slots is not None:
                queries = queries.new_zeros((used, *queries.shape[1:])).index_copy_(0, slots, queries)
            out = _decode_attention_cpu(queries, keys_t[:used, ..., :length], values[:used, :, :length], plan)
            if slots is not None:
                out = out.index_select(0, slots)
            return out.reshape(batch, geo.num_heads, geo.head_dim).to(q.dtype)
        # Padded context per sequence: [B * nb, bs, Hkv, D] -> [B, Hkv, L, D]. index_select
        # copies whole blocks (contiguous runs); advanced indexing of the strided per-layer
        # view copied element by element and was 2-3x slower on CPU.
        shape = (batch, -1, geo.num_kv_heads, geo.head_dim)
        key_buf, value_buf = self._gather_buffers(kv_cache, plan.flat_blocks.numel())
        keys = torch.index_select(kv_cache[:, layer, 0], 0, plan.flat_blocks, out=key_buf)
        values = torch.index_select(kv_cache[:, layer, 1], 0, plan.flat_blocks, out=value_buf)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        # SDPA reads that strided view in place; batched GEMMs would first copy it (2.1x
        # slower on one CPU thread, 32 rows x 304 keys).
        out = F.scaled_dot_product_attention(queries.to(keys.dtype), keys, values, attn_mask=plan.mask)
        return out.reshape(batch, geo.num_heads, geo.head_dim).to(q.dtype)

    def _gather_buffers(self, kv_cache: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Reused across layers and steps: a fresh multi-MB tensor per layer costs page
        # faults (large allocations are mmapped) that took longer than the copy itself.
        shape = (blocks, *kv_cache.shape[3:])
        buf = self._buffers
        if (
            buf is None
            or buf.dtype != kv_cache.dtype
            or buf.device != kv_cache.device
            or buf.shape[2:] != kv_cache.shape[3:]
            or buf.shape[1] < blocks
        ):
            buf = torch.empty(
                (2, max(blocks, 1), *kv_cache.shape[3:]), dtype=kv_cache.dtype, device=kv_cache.device
            )
            self._buffers = buf
        return buf[0, :blocks].view(shape), buf[1, :blocks].view(shape)

    def _prefill_one(
        self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, seq: _PrefillSeq
    ) -> torch.Tensor:
        key_buf, value_buf = self._gather_buffers(kv_cache, seq.blocks.numel())
        keys = torch.index_select(kv_cache[:, layer, 0], 0, seq.blocks, out=key_buf)
        values = torch.index_select(kv_cache[:, layer, 1], 0, seq.blocks, out=value_buf)
        keys = keys.flatten(0, 1)[: seq.kv_len].transpose(0, 1)
        values = values.flatten(0, 1)[: seq.kv_len].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(keys.dtype),
            keys,
            values,
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            enable_gqa=True,
        )
        return out.transpose(0, 1).to(q.dtype)
