"""Reference attention over the paged KV cache in plain torch (CPU and GPU).

Decodes (one new token per sequence) are batched: every decoding sequence's blocks are
gathered into one padded `[B, max_len]` tensor and attended with a single SDPA call
and a length mask; this is the hot path of serving. Prefill chunks run one SDPA per
sequence over that sequence's gathered context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionGeometry, AttentionMetadata, slot_indices, write_kv


@dataclass
class _DecodePlan:
    token_index: torch.Tensor | None  # rows of q that are decodes (None: all of them, in order)
    flat_blocks: torch.Tensor  # [Bd * nb] int64, each decode's first nb table entries
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] bool, True where the key exists


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
        self._decode: _DecodePlan | None = None
        self._prefills: list[_PrefillSeq] = []
        self._geometry: AttentionGeometry | None = None
        self._buffers: torch.Tensor | None = None  # [2, blocks, block_size, kv_heads, head_dim]

    def plan(self, meta: AttentionMetadata, geometry: AttentionGeometry) -> None:
        device = meta.slot_mapping.device
        self._geometry = geometry
        self._slots = slot_indices(meta)
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        self._decode = self._plan_decode(meta, decode_rows, device) if decode_rows else None
        self._prefills = [
            self._plan_prefill(meta, i, device) for i, n in enumerate(meta.query_lens) if n != 1
        ]

    @staticmethod
    def _plan_decode(meta: AttentionMetadata, rows: list[int], device: torch.device) -> _DecodePlan:
        bs = meta.block_size
        kv_lens = [meta.kv_lens_list[i] for i in rows]
        nb = max(-(-n // bs) for n in kv_lens)
        tables = meta.block_tables[:, :nb] if len(rows) == meta.num_seqs else meta.block_tables[rows, :nb]
        lens = torch.tensor(kv_lens, device=device)
        mask = torch.arange(nb * bs, device=device)[None, :] < lens[:, None]
        all_decode = len(rows) == meta.num_seqs
        cu = meta.cu_query_lens.tolist() if not all_decode else None
        index = None if all_decode else torch.tensor([cu[i] for i in rows], device=device)
        return _DecodePlan(index, tables.reshape(-1).long(), mask[:, None, None, :])

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
        if self._decode is not None and not self._prefills:
            return self._decode_batch(q, kv_cache, layer, self._decode)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[self._decode.token_index] = self._decode_batch(
                q[self._decode.token_index], kv_cache, layer, self._decode
            )
        for seq in self._prefills:
            out[seq.start : seq.end] = self._prefill_one(q[seq.start : seq.end], kv_cache, layer, seq)
        return out

    def _decode_batch(
        self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: _DecodePlan
    ) -> torch.Tensor:
        geo = self._geometry
        assert geo is not None
        batch = q.shape[0]
        group = geo.num_heads // geo.num_kv_heads
        # Padded context per sequence: [B * nb, bs, Hkv, D] -> [B, Hkv, L, D]. index_select
        # copies whole blocks (contiguous runs); advanced indexing of the strided per-layer
        # view copied element by element and was 2-3x slower on CPU.
        shape = (batch, -1, geo.num_kv_heads, geo.head_dim)
        key_buf, value_buf = self._gather_buffers(kv_cache, plan.flat_blocks.numel())
        keys = torch.index_select(kv_cache[:, layer, 0], 0, plan.flat_blocks, out=key_buf)
        values = torch.index_select(kv_cache[:, layer, 1], 0, plan.flat_blocks, out=value_buf)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        # GQA without repeating K/V: the `group` query heads sharing a KV head become
        # that head's query rows (head h uses KV head h // group, as in transformers).
        queries = q.reshape(batch, geo.num_kv_heads, group, geo.head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask)
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
