"""Attention over the paged KV cache: metadata, cache writes, and outputs against dense
causal attention computed from each sequence's full K/V."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from triptych.worker.attention import (
    AttentionGeometry,
    AttentionMetadataError,
    TorchAttention,
    build_metadata,
    cpu_decode,
    select_backend,
    torch_backend,
)
from triptych.worker.attention.torch_backend import MAX_DECODE_GROUPS, decode_groups

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 16, 2


@pytest.fixture(params=["torch", "kernel"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decodes through the torch path (batched GEMMs, kept context) or the CPU kernel
    (cpu_decode.c, reading the paged cache in place)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_decode, "kernel", lambda: None)
    elif cpu_decode.kernel() is None:
        pytest.skip("the CPU decode kernel does not build here (no C compiler)")
    return request.param


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path only: these tests look inside its kept context."""
    monkeypatch.setattr(cpu_decode, "kernel", lambda: None)


def test_build_metadata_slots_and_padding() -> None:
    meta = build_metadata([3, 1], [5, 9], [[7, 2, 4], [1, 0, 8, 6, 3]], block_size=2)
    # seq 0: new tokens at cache positions 2,3,4 -> blocks 2,2,4 (table[1], table[1], table[2])
    # seq 1: new token at position 8 -> table[4] = 3, offset 0
    assert meta.slot_mapping.tolist() == [2 * 2 + 0, 2 * 2 + 1, 4 * 2 + 0, 3 * 2 + 0]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.cu_query_lens.tolist() == [0, 3, 4]
    assert meta.cu_query_lens.dtype == torch.int32
    assert meta.kv_lens.tolist() == [5, 9]
    assert meta.block_tables.tolist() == [[7, 2, 4, 0, 0], [1, 0, 8, 6, 3]]
    assert meta.block_tables.dtype == torch.int32
    assert (meta.num_seqs, meta.num_tokens, meta.is_decode_only) == (2, 4, False)
    assert build_metadata([1, 1], [3, 1], [[0, 1], [2]], 2).is_decode_only


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "tables", "block_size", "message"),
    [
        ([2], [1], [[0]], 4, "query_len <= kv_len"),
        ([0], [3], [[0]], 4, "query_len <= kv_len"),
        ([2], [9], [[0, 1]], 4, "cannot hold 9 tokens"),
        ([1, 1], [1], [[0], [1]], 4, "batch size mismatch"),
        ([1], [1], [[0]], 0, "block_size"),
    ],
)
def test_build_metadata_rejects_inconsistent_batches(
    query_lens, kv_lens, tables, block_size, message
) -> None:
    with pytest.raises(AttentionMetadataError, match=message):
        build_metadata(query_lens, kv_lens, tables, block_size)


def test_select_backend_on_cpu_is_torch() -> None:
    assert isinstance(select_backend("cpu"), TorchAttention)


class _PagedRun:
    """Sequences growing in a shared paged cache with shuffled (non-contiguous) blocks; keeps
    each sequence's full K/V and queries so outputs can be checked against dense attention."""

    def __init__(self, block_size: int, num_blocks: int = 256, seed: int = 0) -> None:
        self.block_size = block_size
        self.cache = torch.zeros(num_blocks, LAYERS, 2, block_size, KV_HEADS, DIM)
        self.free = random.Random(seed).sample(range(num_blocks), num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, work: list[tuple[int, int]], backend: TorchAttention, layer: int = 1) -> torch.Tensor:
        """Run one step: `work` = [(seq id, new tokens)]. Returns output minus dense reference."""
        q_parts, k_parts, v_parts, kv_lens = [], [], [], []
        for seq, n in work:
            q_parts.append(torch.randn(n, HEADS, DIM, generator=self.gen))
            k_new = torch.randn(n, KV_HEADS, DIM, generator=self.gen)
            v_new = torch.randn(n, KV_HEADS, DIM, generator=self.gen)
            k_parts.append(k_new)
            v_parts.append(v_new)
            self.keys[seq] = torch.cat([self.keys.get(seq, torch.empty(0, KV_HEADS, DIM)), k_new])
            self.values[seq] = torch.cat([self.values.get(seq, torch.empty(0, KV_HEADS, DIM)), v_new])
            total = self.keys[seq].shape[0]
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < total:
                table.append(self.free.pop())
            kv_lens.append(total)
        meta = build_metadata(
            [n for _, n in work], kv_lens, [self.tables[s] for s, _ in work], self.block_size
        )
        backend.plan(meta, AttentionGeometry(HEADS, KV_HEADS, DIM, torch.float32))
        out = backend.forward(
            torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), self.cache, layer, meta
        )
        ref = torch.cat(
            [self._dense(q, self.keys[s], self.values[s]) for q, (s, _) in zip(q_parts, work, strict=True)]
        )
        return out - ref

    @staticmethod
    def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, total = q.shape[0], k.shape[0]
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
        causal = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_torch_attention_mixed_prefill_chunks_and_decodes(block_size: int, decode_path: str) -> None:
    run = _PagedRun(block_size)
    backend = TorchAttention()
    assert run.step([(0, 7), (1, 20)], backend).abs().max() < 1e-5  # two fresh prefills
    assert run.step([(0, 1), (1, 9), (2, 3)], backend).abs().max() < 1e-5  # decode + chunk + fresh
    assert run.step([(2, 1), (0, 1), (1, 1)], backend).abs().max() < 1e-5  # all decodes
    assert run.step([(1, 1), (2, 18), (0, 1)], backend).abs().max() < 1e-5  # chunk amid decodes


def test_short_chunks_go_to_the_cpu_kernel_row_by_row_and_long_ones_to_sdpa(
        decode_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks up to KERNEL_MAX_QUERY rows (a migrated decode's fed tokens, a short suffix)
    are the kernel's rows, each query row seeing the cache up to its own position; longer
    ones keep one SDPA each. Exact either way."""
    sdpa = F.scaled_dot_product_attention
    calls: list[int] = []

    def counted(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(q.shape[-2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    run = _PagedRun(block_size=16, seed=5)
    backend = TorchAttention()
    longest = torch_backend.KERNEL_MAX_QUERY
    assert run.step([(0, longest + 6), (1, 3), (2, longest)], backend).abs().max() < 1e-5
    assert run.step([(0, 1), (1, 2), (2, longest + 1), (3, 1)], backend).abs().max() < 1e-5
    if decode_path == "kernel":
        assert calls == [longest + 6, longest + 1]  # only the chunks over the bound
    else:  # no kernel: every chunk through SDPA (decodes too, where they are not kept)
        assert {longest + 6, 3, longest, 2, longest + 1} <= set(calls)


def test_torch_attention_batched_decode_of_unequal_lengths(decode_path: str) -> None:
    run = _PagedRun(block_size=4, seed=3)
    backend = TorchAttention()
    lengths = [1, 5, 17, 33, 2]
    for seq, n in enumerate(lengths):
        run.step([(seq, n)], backend)
    for _ in range(3):
        diff = run.step([(seq, 1) for seq in range(len(lengths))], backend)
        assert diff.abs().max() < 1e-5


def test_decode_groups_split_long_tailed_lengths_only() -> None:
    assert decode_groups([40, 41, 42, 47], 16) == [[0, 1, 2, 3]]  # same padded length: one group, in order
    assert decode_groups([], 16) == []
    groups = decode_groups([20, 600, 30, 25, 310, 18], 16)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups[0] == [1]  # the 600-token row is not padded onto the short ones
    assert [0, 2, 3, 5] in groups  # same padded length: together
    assert decode_groups([33, 20, 47, 40], 16) == [[0, 1, 2, 3]]  # not worth a split: batch order
    # prompts of different lengths decoding together (a uniform batch): padding is a third
    # of the real keys, so one group (which keeps its context across steps)
    assert decode_groups([40] * 20 + [72] * 12, 16) == [list(range(32))]
    assert len(decode_groups([16 * k for k in range(1, 200)], 16)) == MAX_DECODE_GROUPS


def test_grouped_decodes_of_long_tailed_lengths_match_dense(decode_path: str) -> None:
    run = _PagedRun(block_size=4, num_blocks=512, seed=5)
    backend = TorchAttention()
    lengths = [3, 700, 6, 2, 350, 5, 4]
    for seq, n in enumerate(lengths):
        run.step([(seq, n)], backend)
    assert len(decode_groups([n + 1 for n in lengths], 4)) > 1  # the case under test
    for _ in range(2):
        diff = run.step([(seq, 1) for seq in range(len(lengths))], backend)
        assert diff.abs().max() < 1e-5
    # decodes in two groups around a prefill chunk
    diff = run.step([(1, 1), (0, 1), (7, 9), (4, 1), (2, 1)], backend)
    assert diff.abs().max() < 1e-5


def test_steady_decodes_reuse_kept_context_and_match_dense(torch_path: None) -> None:
    run = _PagedRun(block_size=4, seed=7)
    backend = TorchAttention()
    for seq, n in enumerate([6, 3, 11]):
        run.step([(seq, n)], backend)
    for step in range(6):  # rows of unequal lengths cross block boundaries at different steps
        assert run.step([(0, 1), (1, 1), (2, 1)], backend).abs().max() < 1e-5
        # the first decode step gathers as usual, the second (steady) one into the kept
        # context, the rest only append to it
        assert backend._kept.continuing == (step > 1)


def test_rows_leaving_and_joining_keep_their_slots_and_match_dense(torch_path: None) -> None:
    run = _PagedRun(block_size=4, seed=9)
    backend = TorchAttention()
    for seq, n in enumerate([6, 3, 11, 5]):
        run.step([(seq, n)], backend)
    for _ in range(3):
        run.step([(0, 1), (1, 1), (2, 1)], backend)
    kept = backend._kept
    assert kept.continuing and kept.row_slots == [0, 1, 2]
    assert kept.layout is not None and kept.layout.slots == 7  # room for four to join
    buffer = kept.buffer
    # sequence 1 leaves, 3 joins (prefilled earlier), the order changes: the rows that
    # continue keep their slots in place, 3 is gathered into the lowest free one (1's)
    assert run.step([(2, 1), (3, 1), (0, 1)], backend).abs().max() < 1e-5
    assert kept.continuing and kept.relayout is None and kept.buffer == buffer
    assert kept.fresh == [1] and kept.row_slots == [2, 1, 0]
    for _ in range(2):  # and they go on appending
        assert run.step([(2, 1), (3, 1), (0, 1)], backend).abs().max() < 1e-5
        assert kept.continuing and kept.fresh == []
    # a mixed step (a prefill chunk beside the decodes) keeps its decode rows' slots too
    assert run.step([(0, 1), (4, 7), (2, 1)], backend).abs().max() < 1e-5
    assert kept.continuing and kept.fresh == [] and kept.row_slots == [0, 2]
    assert run.step([(0, 1), (2, 1)], backend).abs().max() < 1e-5
    # more rows than slots: the rows that continue are copied into a larger layout
    for seq in range(5, 12):
        run.step([(seq, 3 + seq)], backend)
    rows = [0, 2, 5, 6, 7, 8, 9]
    assert run.step([(seq, 1) for seq in rows], backend).abs().max() < 1e-5  # nothing kept: gathered
    assert run.step([(seq, 1) for seq in rows], backend).abs().max() < 1e-5
    assert kept.layout.slots >= len(rows)
    run.step([(seq, 1) for seq in rows], backend)
    grown = [0, 2, 5, 6, 7, 8, 9, 4, 1, 3, 10, 11]
    assert run.step([(seq, 1) for seq in grown], backend).abs().max() < 1e-5
    assert kept.relayout is not None and kept.buffer != buffer
    assert kept.relayout.source.numel() == len(rows) and kept.fresh == [7, 8, 9, 10, 11]
    assert kept.layout.slots >= len(grown)
    assert kept.row_slots[6] == 6 and kept.used == 12
    # one row left, in slot 6: the free slots before it would be wasted attention, so it
    # moves into a small layout
    assert run.step([(9, 1)], backend).abs().max() < 1e-5
    assert kept.relayout is not None and kept.fresh == [] and kept.layout.slots == 5
    assert kept.row_slots == [0] and kept.used == 1
    assert run.step([(9, 1)], backend).abs().max() < 1e-5
    assert kept.continuing


def test_a_row_outgrowing_the_kept_width_is_copied_into_a_wider_layout(torch_path: None) -> None:
    run = _PagedRun(block_size=4, seed=10)
    backend = TorchAttention()
    for seq, n in enumerate([6, 3, 11]):
        run.step([(seq, n)], backend)
    grown = []
    for _ in range(30):
        assert run.step([(0, 1), (1, 1), (2, 1)], backend).abs().max() < 1e-5
        kept = backend._kept
        if kept.relayout is not None:
            assert kept.fresh == []  # every row continues: copied, none gathered
            grown.append((kept.relayout.prev.width_blocks, kept.layout.width_blocks))
    assert grown and all(old < new for old, new in grown)


def test_kept_context_is_not_read_after_another_step_reused_its_blocks(torch_path: None) -> None:
    run = _PagedRun(block_size=4, seed=8)
    backend = TorchAttention()
    run.step([(0, 5)], backend)
    run.step([(1, 2)], backend)
    for _ in range(3):
        run.step([(0, 1), (1, 1)], backend)
    assert backend._kept.continuing
    # Another step runs in between (a prefill), and sequence 0's blocks get new contents
    # (as when a request ends and a new one is prefilled into the freed blocks).
    run.step([(2, 4)], backend)
    fresh = torch.randn(run.keys[0].shape, generator=run.gen)
    run.keys[0] = fresh.clone()
    for pos in range(fresh.shape[0]):
        block = run.tables[0][pos // run.block_size]
        run.cache[block, 1, 0, pos % run.block_size] = fresh[pos]
    diff = run.step([(0, 1), (1, 1)], backend)  # lengths and tables continue the kept ones
    assert diff.abs().max() < 1e-5


def test_kv_written_at_slot_mapping_only_in_its_layer(decode_path: str) -> None:
    backend = TorchAttention()
    cache = torch.zeros(6, LAYERS, 2, 2, KV_HEADS, DIM)
    meta = build_metadata([3], [3], [[4, 1]], block_size=2)
    k, v = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    backend.plan(meta, AttentionGeometry(HEADS, KV_HEADS, DIM, torch.float32))
    backend.forward(torch.randn(3, HEADS, DIM), k, v, cache, 1, meta)
    assert torch.equal(cache[4, 1, 0], k[:2]) and torch.equal(cache[1, 1, 0, 0], k[2])
    assert torch.equal(cache[4, 1, 1], v[:2]) and torch.equal(cache[1, 1, 1, 0], v[2])
    assert cache[:, 0].abs().sum() == 0  # the other layer is untouched
    assert cache[1, 1, :, 1].abs().sum() == 0 and cache[[0, 2, 3, 5]].abs().sum() == 0


def test_forward_before_plan_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="plan"):
        TorchAttention().forward(
            torch.zeros(1, HEADS, DIM),
            torch.zeros(1, KV_HEADS, DIM),
            torch.zeros(1, KV_HEADS, DIM),
            torch.zeros(1, LAYERS, 2, 1, KV_HEADS, DIM),
            0,
            build_metadata([1], [1], [[0]], 1),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs CUDA")
@pytest.mark.parametrize("decode_only", [False, True])
def test_flashinfer_matches_torch_backend(decode_only: bool) -> None:
    pytest.importorskip("flashinfer")
    from triptych.worker.attention.flashinfer_backend import FlashInferAttention

    heads, kv_heads, dim, block_size, device = 8, 2, 128, 16, torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.zeros(64, 2, 2, block_size, kv_heads, dim, dtype=torch.float16, device=device)
    tables = [random.Random(1).sample(range(64), 64)[i * 8 : (i + 1) * 8] for i in range(3)]
    # Fill earlier context (positions < kv_len - q_len) with random K/V.
    kv_lens, query_lens = [40, 7, 100], ([1, 1, 1] if decode_only else [13, 7, 1])
    for table, kv_len in zip(tables, kv_lens, strict=True):
        for pos in range(kv_len):
            cache[table[pos // block_size], :, :, pos % block_size] = torch.randn(
                2, 2, kv_heads, dim, generator=gen
            ).to(device, torch.float16)
    meta = build_metadata(query_lens, kv_lens, tables, block_size, device=device)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim, generator=gen).to(device, torch.float16)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, torch.float16)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(device, torch.float16)
    geometry = AttentionGeometry(heads, kv_heads, dim, torch.float16)
    outs = []
    for backend in (FlashInferAttention(device), TorchAttention()):
        backend.plan(meta, geometry)
        outs.append(backend.forward(q, k, v, cache.clone(), 1, meta).float())
    assert (outs[0] - outs[1]).abs().max() < 2e-2


def test_select_backend_keeps_torch_where_flashinfer_cannot_run() -> None:
    # fp32 and odd head sizes are outside FlashInfer's kernels even on CUDA.
    assert isinstance(select_backend("cuda", head_dim=16, dtype=torch.float16), TorchAttention)
    assert isinstance(select_backend("cuda", head_dim=128, dtype=torch.float32), TorchAttention)


def test_one_backend_serves_caches_of_different_block_sizes(decode_path: str) -> None:
    # The backend reuses its gather buffers across steps; they must follow the cache shape.
    backend = TorchAttention()
    for block_size in (16, 1, 16, 4):
        run = _PagedRun(block_size, seed=block_size)
        assert run.step([(0, 9), (1, 1)], backend).abs().max() < 1e-5
        assert run.step([(0, 1), (1, 1)], backend).abs().max() < 1e-5
