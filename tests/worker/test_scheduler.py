"""Stage-level batching (TriInfer Alg. 1) on the real scheduler and caches, no model:
`_advance` plays the engine's part (embeddings become ready, tokens get computed/sampled)."""

from __future__ import annotations

import pytest
import torch
from engine_cases import Item

from triptych.topology import Stage
from triptych.worker.engine.batch import ScheduledBatch
from triptych.worker.engine.kv_cache import BlockAllocator, KVCache, OutOfBlocksError
from triptych.worker.engine.mm_cache import MMCache
from triptych.worker.engine.request import Request, RequestStatus
from triptych.worker.engine.scheduler import Scheduler, SchedulerConfig


def _kv(num_blocks: int, block_size: int = 4) -> KVCache:
    return KVCache(num_blocks=num_blocks, num_layers=1, num_kv_heads=1, head_dim=2, block_size=block_size,
                   dtype=torch.float32, device="cpu")


def _mm(num_blocks: int = 64, rows: int = 4) -> MMCache:
    return MMCache(num_blocks=num_blocks, rows_per_block=rows, hidden_size=2, dtype=torch.float32, device="cpu")


def _sched(tokens: int = 16, images: int = 2, seqs: int = 8, kv_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(tokens, images, seqs), _kv(kv_blocks), _mm())


def _req(rid: str, n: int, items: list[Item] = (), **kw) -> Request:
    images = {it.content_hash: b"img" for it in items}
    return Request(rid, list(range(n)), mm_items=list(items), images=images, **kw)


def _advance(s: Scheduler, batch: ScheduledBatch) -> None:
    for req, i in batch.encodes:
        entry = req.mm_entries[i]
        s.mm.write(entry, torch.ones(entry.num_rows, 2))
        s.mm.commit(entry)
    for c in batch.chunks:
        c.req.num_computed_tokens = c.end
        s.release_passed_mm(c.req)
        if c.samples:
            c.req.prefill_done = True
            c.req.output_token_ids.append(0)


def _spans(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    return [(c.req.request_id, c.start, c.end) for c in batch.chunks]


def test_decodes_first_then_prefill_chunks_to_the_token_budget() -> None:
    s = _sched(tokens=10)
    a, b = _req("a", 4), _req("b", 30)
    s.add(a)
    _advance(s, s.schedule())  # a prefilled in one step
    assert a.prefill_done
    s.add(b)
    batch = s.schedule()
    assert _spans(batch) == [("a", 4, 5), ("b", 0, 9)]  # 1 decode + 9 prefill tokens = budget 10
    _advance(s, batch)
    assert _spans(s.schedule()) == [("a", 5, 6), ("b", 9, 18)]


def test_prefill_stops_at_the_first_unencoded_image_and_may_end_inside_a_span() -> None:
    s = _sched(tokens=7, images=1)
    r = _req("r", 20, [Item(3, 6, "h1"), Item(12, 4, "h2")])
    s.add(r)
    assert r.status == RequestStatus.WAITING_ENCODE
    b1 = s.schedule()
    assert [(x.request_id, i) for x, i in b1.encodes] == [("r", 0)]  # image budget 1
    assert _spans(b1) == [("r", 0, 3)]  # text before the first image
    assert r.status == RequestStatus.ENCODING
    _advance(s, b1)
    b2 = s.schedule()
    assert [(x.request_id, i) for x, i in b2.encodes] == [("r", 1)]
    assert _spans(b2) == [("r", 3, 10)]  # image 1 [3, 9) is ready; image 2 at 12 is not
    _advance(s, b2)
    b3 = s.schedule()
    assert _spans(b3) == [("r", 10, 17)]
    s2 = _sched(tokens=5, images=2)
    q = _req("q", 20, [Item(2, 8, "x")])
    s2.add(q)
    _advance(s2, s2.schedule())
    assert _spans(s2.schedule()) == [("q", 2, 7)]  # chunk boundary at 7, inside the span [2, 10)


def test_encode_and_prefill_share_an_iteration_within_their_budgets() -> None:
    s = _sched(tokens=8, images=2)
    text, img = _req("t", 6), _req("i", 12, [Item(0, 4, "a"), Item(4, 4, "b"), Item(8, 2, "c")])
    s.add(img)
    s.add(text)
    batch = s.schedule()
    assert len(batch.encodes) == 2  # image budget
    assert _spans(batch) == [("t", 0, 6)]  # i has nothing encoded yet
    _advance(s, batch)
    batch = s.schedule()
    assert [i for _, i in batch.encodes] == [2]
    assert _spans(batch) == [("t", 6, 7), ("i", 0, 7)]


def test_encode_token_budget_admits_items_while_budget_is_left() -> None:
    """UnifiedServe Alg. 3 lines 17-19: items are added while n_e < alpha, so the last may
    overshoot and one item always runs; the image budget still applies."""
    s = Scheduler(SchedulerConfig(64, 8, 8, encode_token_budget=5), _kv(64), _mm())
    img = _req("i", 16, [Item(0, 4, "a"), Item(4, 4, "b"), Item(8, 6, "c"), Item(14, 1, "d")])
    s.add(img)
    batch = s.schedule()
    assert [i for _, i in batch.encodes] == [0, 1]  # 4 < 5 admits b; 8 >= 5 stops
    _advance(s, batch)
    assert [i for _, i in s.schedule().encodes] == [2]  # 6 tokens > alpha: still one runs
    big = Scheduler(SchedulerConfig(64, 8, 8, encode_token_budget=100), _kv(64), _mm())
    big.add(_req("j", 16, [Item(0, 4, "a"), Item(4, 4, "b"), Item(8, 6, "c"), Item(14, 1, "d")]))
    assert len(big.schedule().encodes) == 4


def test_repeated_image_is_encoded_once_and_cached_across_requests() -> None:
    s = _sched(tokens=64, images=4)
    a = _req("a", 12, [Item(0, 4, "same"), Item(6, 4, "same")])
    s.add(a)
    batch = s.schedule()
    assert len(batch.encodes) == 1
    _advance(s, batch)
    b = _req("b", 8, [Item(2, 4, "same")])
    s.add(b)
    assert s.counters.mm_cache_hits >= 1
    assert b.status == RequestStatus.WAITING_PREFILL
    batch = s.schedule()
    assert not batch.encodes and ("b", 0, 8) in _spans(batch)


def test_preemption_takes_the_latest_arrival_and_recomputes_prompt_plus_output() -> None:
    s = _sched(tokens=64, kv_blocks=6)  # 24 token slots of 4
    a, b = _req("a", 8), _req("b", 8)
    s.add(a)
    s.add(b)
    _advance(s, s.schedule())  # both prefilled, 2 blocks each + first token
    for _ in range(6):
        _advance(s, s.schedule())
    # a, b hold 15 tokens each -> need 4 blocks each; only 6 exist: b (later) was preempted
    assert s.counters.preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_tokens == 15 and a.prefill_done
    assert s.kv.num_used == len(a.block_ids) + len(b.block_ids)
    # b's recompute prefills prompt + generated tokens once a finishes
    generated = b.num_tokens - b.num_prompt_tokens
    s.remove(a)
    batch = s.schedule()
    assert _spans(batch) == [("b", 0, b.num_tokens)]
    assert generated > 0 and b.num_tokens > b.num_prompt_tokens


def test_a_request_preempts_itself_when_it_is_the_latest() -> None:
    s = _sched(tokens=64, kv_blocks=4)
    a, b = _req("a", 8), _req("b", 7)
    s.add(a)
    s.add(b)
    _advance(s, s.schedule())
    assert s.kv.num_free == 0
    batch = s.schedule()  # a (8 tokens -> 9) needs a third block: b is preempted; b then waits
    assert _spans(batch) == [("a", 8, 9)]
    assert b in s.waiting and b.block_ids == [] and b.num_computed_tokens == 0


def test_max_num_seqs_and_fifo_admission() -> None:
    s = _sched(tokens=100, seqs=2)
    for i in range(4):
        s.add(_req(f"r{i}", 5))
    batch = s.schedule()
    assert [c.req.request_id for c in batch.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_encode_only_requests_never_prefill() -> None:
    s = Scheduler(SchedulerConfig(100, 4, 8), None, _mm())
    r = _req("e", 10, [Item(2, 4, "z")], stages=frozenset({Stage.ENCODE}))
    s.add(r)
    batch = s.schedule()
    assert len(batch.encodes) == 1 and not batch.chunks
    _advance(s, batch)
    assert not s.schedule().chunks
    s.park(r)
    assert r.status == RequestStatus.PARKED and s.mm.get("z").refcount == 1
    s.remove(r)
    assert s.mm.get("z").refcount == 0  # cached, evictable


def test_remove_frees_every_block() -> None:
    s = _sched(tokens=6)
    r = _req("r", 20, [Item(0, 4, "k")])
    s.add(r)
    _advance(s, s.schedule())
    s.schedule()
    assert s.kv.num_used > 0 and s.mm.get("k").refcount == 1
    s.remove(r)
    assert s.kv.num_used == 0 and s.mm.get("k").refcount == 0 and not s.running


# --- caches ---------------------------------------------------------------------------

def test_block_allocator_shuffled_free_list() -> None:
    alloc = BlockAllocator(32, shuffle_seed=1)
    ids = alloc.allocate(10)
    assert ids != sorted(ids) and len(set(ids)) == 10
    assert alloc.num_used == 10 and alloc.num_free == 22
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(23)
    alloc.free(ids)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(ids[:1])
    assert alloc.num_free == 32


def test_kv_cache_tensor_is_block_major_and_never_reallocated() -> None:
    kv = KVCache(num_blocks=5, num_layers=3, num_kv_heads=2, head_dim=4, block_size=8,
                 dtype=torch.float32, device="cpu")
    assert tuple(kv.tensor.shape) == (5, 3, 2, 8, 2, 4)
    ptr = kv.tensor.data_ptr()
    kv.free(kv.allocate(5))
    assert kv.tensor.data_ptr() == ptr and kv.bytes_per_block == 3 * 2 * 8 * 2 * 4 * 4


def test_mm_cache_rows_round_trip_over_scattered_blocks_and_lru_eviction() -> None:
    mm = MMCache(num_blocks=6, rows_per_block=3, hidden_size=2, dtype=torch.float32, device="cpu", shuffle_seed=4)
    rows = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    e = mm.allocate("a", 7)  # 3 blocks
    mm.write(e, rows)
    mm.commit(e)
    assert torch.equal(mm.read(e), rows) and torch.equal(mm.read(e, 2, 5), rows[2:5])
    f = mm.allocate("b", 9)  # 3 more: cache full
    with pytest.raises(OutOfBlocksError):
        mm.allocate("c", 1)  # both referenced
    mm.release(e)  # a: refcount 0, stays cached
    assert mm.get("a") is not None and mm.acquire("a") is e
    mm.release(e)
    c = mm.allocate("c", 1)  # evicts a (least recently used, unreferenced)
    assert mm.get("a") is None and mm.get("c") is c and f.refcount == 1


def test_queued_work_per_stage_follows_requests_through_their_stages() -> None:
    s = _sched(tokens=6, images=1, seqs=8)
    img = _req("img", 20, [Item(2, 4, "q1"), Item(8, 4, "q2")])  # 2 images, 20 prompt tokens
    txt = _req("txt", 9)
    s.add(img)
    s.add(txt)
    arriving = _req("new", 5, [Item(0, 4, "q3")])
    q = s.queued_work([arriving])
    assert (q[Stage.ENCODE].requests, q[Stage.PREFILL].requests, q[Stage.DECODE].requests) == (2, 1, 0)
    assert q[Stage.ENCODE].images == 3 and q[Stage.PREFILL].tokens == 20 + 9 + 5
    _advance(s, s.schedule())  # step 1: img's first image encodes, its 2 text tokens + txt's first 4 prefill
    q = s.queued_work()
    assert q[Stage.ENCODE].images == 1  # q2 still to encode; q1 encoded
    assert q[Stage.ENCODE].requests == q[Stage.PREFILL].requests == 0  # both admitted
    assert q[Stage.PREFILL].tokens == (20 - 2) + (9 - 4)
    for _ in range(10):
        _advance(s, s.schedule())
    q = s.queued_work()
    assert img.prefill_done and txt.prefill_done
    assert q[Stage.ENCODE].images == q[Stage.PREFILL].tokens == 0


def test_queued_work_counts_only_the_stages_an_instance_runs() -> None:
    e_only = Scheduler(SchedulerConfig(100, 4, 8), None, _mm())
    e_only.add(_req("e", 10, [Item(2, 4, "z")], stages=frozenset({Stage.ENCODE})))
    q = e_only.queued_work()
    assert (q[Stage.ENCODE].requests, q[Stage.ENCODE].images, q[Stage.PREFILL].tokens) == (1, 1, 0)
    p_only = _sched()  # P of E+P: the embeddings come from elsewhere
    p_only.add(_req("p", 10, [Item(2, 4, "y")], stages=frozenset({Stage.PREFILL})))
    q = p_only.queued_work()
    assert (q[Stage.ENCODE].images, q[Stage.PREFILL].requests, q[Stage.PREFILL].tokens) == (0, 1, 10)
