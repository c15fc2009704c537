"""Automatic prefix caching: exact greedy parity (fp32) with transformers `generate()` when
prompts reuse cached KV blocks — whole and partial-block prefixes, a prefix through an
image (the same image shares, a different one must not), preemption with cached blocks,
and a long system prompt shared by 32 concurrent requests whose prefill is computed once.
Plus the block pool's reference counting and LRU eviction, without a model."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch
from engine_cases import Case, processor, to_request
from hf_reference import hf_generate, make_test_image

from triptych.prefix_hash import block_hashes
from triptych.worker.engine import Engine, EngineConfig, RequestStatus
from triptych.worker.engine.kv_cache import KVCache, OutOfBlocksError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py

SYSTEM = ("You are a careful assistant. Answer briefly, cite nothing, and never repeat the question. "
          "Prefer plain words over jargon; if unsure, say so. ") * 3
QUESTIONS = ["hi", "what is two plus two", "name a colour", "tell me a story about a fox",
             "count to five", "why is the sky blue", "say something kind", "list three fruits"]


def _case(question: str, images: tuple = (), system: str = SYSTEM) -> Case:
    user = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    return Case([{"role": "system", "content": [{"type": "text", "text": system}]},
                 {"role": "user", "content": user}], list(images))


@lru_cache(maxsize=64)
def _hf(model_dir: Path, question: str, image_seeds: tuple[int, ...] = (), system: str = SYSTEM) -> tuple[int, ...]:
    return tuple(hf_generate(model_dir, _case(question, _images(image_seeds), system).messages,
                             _images(image_seeds), 10))


def _images(seeds: tuple[int, ...]) -> tuple:
    return tuple(make_test_image(s, 56, 56) for s in seeds)


def _engine(model_dir: Path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), shuffle_seed=5, **{"num_kv_blocks": 256, **kw}))


def _run(engine: Engine, model_dir: Path, specs: list[tuple[str, tuple[int, ...]]], prefix: str = "r") -> list:
    proc = processor(model_dir)
    reqs = [to_request(proc, _case(q, _images(seeds)), f"{prefix}{i}") for i, (q, seeds) in enumerate(specs)]
    engine.generate_batch(reqs)
    for req, (q, seeds) in zip(reqs, specs, strict=True):
        assert req.status == RequestStatus.FINISHED and req.error is None, req.error
        assert tuple(req.output_token_ids) == _hf(model_dir, q, seeds), (req.request_id, q, seeds)
    return reqs


def _counters(engine: Engine) -> dict[str, int]:
    return engine.stats()["counters"]


def _assert_no_leak(engine: Engine) -> None:
    kv = engine.stats()["kv_cache"]
    assert kv["used"] == 0 and kv["free"] == kv["num_blocks"], kv


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- parity with hits ---------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16, 5, 1])
def test_shared_system_prompt_hits_keep_parity(qwen2_vl_dir: Path, block_size: int) -> None:
    """A second wave of requests reuses the first wave's blocks: the prefix shared with
    them (ending mid-block for 16 and 5) is not computed again, and outputs are exact."""
    engine = _engine(qwen2_vl_dir, block_size=block_size, num_kv_blocks=4096 // block_size)
    first = _run(engine, qwen2_vl_dir, [(QUESTIONS[0], ())], "a")
    before = _counters(engine)
    second = _run(engine, qwen2_vl_dir, [(q, ()) for q in QUESTIONS[1:4]], "b")
    after = _counters(engine)
    shared = _common_prefix(first[0].prompt_token_ids, second[0].prompt_token_ids)
    cached = shared // block_size * block_size
    assert shared > 100 and (block_size == 1 or shared % block_size)  # partial block at the end
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits == 3 * cached
    assert after["prefill_tokens"] - before["prefill_tokens"] == sum(r.num_prompt_tokens for r in second) - hits
    _assert_no_leak(engine)
    assert engine.stats()["kv_cache"]["cached"] > 0


def test_identical_prompt_computes_only_its_last_token(qwen2_vl_dir: Path) -> None:
    """A repeat of a prompt whose length is a multiple of the block size: every block is
    cached, yet the last one is computed (the first sample needs its last position)."""
    proc = processor(qwen2_vl_dir)
    n = len(to_request(proc, _case(QUESTIONS[4]), "x").prompt_token_ids)
    engine = _engine(qwen2_vl_dir, block_size=n // 4 if n % 4 == 0 else n, num_kv_blocks=64)
    bs = engine.kv.block_size
    assert n % bs == 0
    _run(engine, qwen2_vl_dir, [(QUESTIONS[4], ())], "a")
    before = _counters(engine)
    _run(engine, qwen2_vl_dir, [(QUESTIONS[4], ())], "b")
    after = _counters(engine)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == n - bs
    assert after["prefill_tokens"] - before["prefill_tokens"] == bs
    _assert_no_leak(engine)


def test_prefix_through_an_image_is_shared_only_with_the_same_image(tiny_model_dir: Path) -> None:
    """Same text, same image: the hit runs past the image (not encoded again; M-RoPE
    positions after it stay right). Same text, another image of the same size (identical
    placeholder token ids): the hit stops before the image."""
    engine = _engine(tiny_model_dir, block_size=4, num_kv_blocks=1024)
    q = "describe it in one short sentence, please, with care and detail"
    first = _run(engine, tiny_model_dir, [(q, (1,))], "a")[0]
    item = first.mm_items[0]
    c0, encoded0 = _counters(engine), _counters(engine)["images_encoded"]
    same = _run(engine, tiny_model_dir, [(q, (1,))], "b")[0]
    c1 = _counters(engine)
    assert c1["prefix_cache_hits"] - c0["prefix_cache_hits"] > item.offset + item.length
    assert c1["images_encoded"] == encoded0  # the cached prefix covers the whole image span
    other = _run(engine, tiny_model_dir, [(q, (2,))], "c")[0]
    c2 = _counters(engine)
    assert other.prompt_token_ids == same.prompt_token_ids  # only the pixels differ
    assert c2["prefix_cache_hits"] - c1["prefix_cache_hits"] <= item.offset
    assert c2["images_encoded"] == encoded0 + 1
    _assert_no_leak(engine)


def test_preemption_with_cached_blocks(qwen2_vl_dir: Path) -> None:
    """A KV cache too small for all of them at once: requests sharing the system prompt are
    preempted and recomputed while cached blocks are shared, freed, evicted and hit again."""
    proc = processor(qwen2_vl_dir)
    specs = [(q, ()) for q in QUESTIONS]
    longest = max(len(to_request(proc, _case(q), "x").prompt_token_ids) for q, _ in specs) + 10
    blocks = -(-longest // 4) + 6  # the longest fits alone; a few at a time do not
    engine = _engine(qwen2_vl_dir, block_size=4, num_kv_blocks=blocks, token_budget=64)
    reqs = _run(engine, qwen2_vl_dir, specs)
    c = _counters(engine)
    assert c["preemptions"] > 0 and any(r.num_preemptions for r in reqs)
    assert c["prefix_cache_hits"] > 0 and engine.stats()["kv_cache"]["evicted"] > 0
    _assert_no_leak(engine)


def test_thirty_two_concurrent_requests_compute_the_shared_prompt_once(qwen2_vl_dir: Path) -> None:
    questions = [f"{chr(ord('A') + i)}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(32)]
    engine = _engine(qwen2_vl_dir, block_size=16, num_kv_blocks=1024, token_budget=4096)
    proc = processor(qwen2_vl_dir)
    reqs = [to_request(proc, _case(q), f"r{i}") for i, q in enumerate(questions)]
    engine.generate_batch(reqs)  # all 32 are waiting before the first step
    pairs = {_common_prefix(a.prompt_token_ids, b.prompt_token_ids) for a in reqs for b in reqs if a is not b}
    assert len(pairs) == 1  # they share the system prompt, and nothing after it
    shared = pairs.pop()
    cached = shared // 16 * 16
    assert cached > 100
    c = _counters(engine)
    total = sum(r.num_prompt_tokens for r in reqs)
    assert c["prefix_cache_queries"] == total
    assert c["prefix_cache_hits"] == 31 * cached  # every request but the first reused it
    assert c["prefill_tokens"] == total - 31 * cached  # the shared blocks were computed once
    for req, q in zip(reqs, questions, strict=True):
        assert tuple(req.output_token_ids) == _hf(qwen2_vl_dir, q), req.request_id
    _assert_no_leak(engine)


def test_prefix_caching_off(qwen2_vl_dir: Path) -> None:
    engine = _engine(qwen2_vl_dir, block_size=16, enable_prefix_caching=False)
    reqs = _run(engine, qwen2_vl_dir, [(QUESTIONS[0], ())] * 2)
    c = _counters(engine)
    assert c["prefix_cache_hits"] == 0 and c["prefill_tokens"] == 2 * reqs[0].num_prompt_tokens
    assert engine.stats()["kv_cache"]["cached"] == 0
    _assert_no_leak(engine)


# --- the block pool -------------------------------------------------------------------------

def _kv(n: int, block_size: int = 2) -> KVCache:
    return KVCache(num_blocks=n, num_layers=1, num_kv_heads=1, head_dim=2, block_size=block_size,
                   dtype=torch.float32, device="cpu", prefix_caching=True)


def test_cached_blocks_are_shared_counted_free_and_evicted_only_when_needed() -> None:
    kv = _kv(6)
    hashes = block_hashes(list(range(6)), [], 2)
    a = kv.allocate(3)
    for block, h in zip(a, hashes, strict=True):
        assert kv.register(block, h)
    other = block_hashes([9, *range(1, 6)], [], 2)  # differs in the first token: no block shared
    assert kv.cached_prefix(hashes) == a and kv.cached_prefix(other) == []
    kv.touch(a[:2])  # a second request shares the first two blocks
    assert kv.num_used == 3 and kv.num_free == 3
    kv.free(a)
    assert kv.num_used == 2 and kv.num_free == 4 and kv.num_cached == 3  # a[2] cached, evictable
    fresh = kv.allocate(3)  # never-cached blocks go first: nothing evicted
    assert set(fresh).isdisjoint(a) and kv.num_cached == 3
    kv.free(fresh)
    taken = kv.allocate(4)  # now a cached, unreferenced block must go
    assert a[2] in taken and kv.num_cached == 2
    assert kv.cached_prefix(hashes) == a[:2]  # the still-referenced prefix survived
    with pytest.raises(OutOfBlocksError):
        kv.allocate(1)  # the referenced cached blocks are never evicted
    kv.free(taken)
    kv.free(a[:2])
    assert kv.num_used == 0 and kv.num_free == 6 and kv.num_cached == 2
    with pytest.raises(ValueError, match="double free"):
        kv.free(a[:1])


def test_a_duplicate_block_stays_uncached_and_tail_blocks_are_evicted_first() -> None:
    kv = _kv(4)
    hashes = block_hashes(list(range(4)), [], 2)
    a, b = kv.allocate(2), kv.allocate(2)
    assert kv.register(a[0], hashes[0]) and kv.register(a[1], hashes[1])
    assert not kv.register(b[0], hashes[0])  # computed twice at once: the first one is kept
    kv.free(b)
    assert kv.num_cached == 2
    kv.free(a)  # tail first: a[1] is the least recently freed
    assert kv.allocate(3)[2] == a[1] and kv.cached_prefix(hashes) == [a[0]]


def test_hash_chain_mixes_in_image_content_and_is_stable() -> None:
    class Item:
        def __init__(self, h: str, offset: int = 4) -> None:
            self.offset, self.length, self.content_hash = offset, 4, h

    ids = list(range(12))
    x, y = block_hashes(ids, [Item("x")], 4), block_hashes(ids, [Item("y")], 4)
    assert len(x) == 3 and x[0] == y[0] and x[1] != y[1] and x[2] != y[2]  # y's chain differs from the image on
    assert block_hashes(ids, [Item("x")], 4, num_tokens=11) == x[:2]
    assert x[0] == block_hashes(ids[:4], [], 4)[0] != block_hashes(ids, [Item("x", offset=3)], 4)[0]
    assert x == block_hashes(list(ids), [Item("x")], 4)  # deterministic (no per-process hash seed)


def test_a_parked_handoff_keeps_its_shared_blocks_under_eviction_pressure(qwen2_vl_dir: Path) -> None:
    """P parks a prefill for D to pull; while its lease is out, requests share its cached
    prefix and others force evictions: its blocks are never evicted or overwritten, and D
    decodes from them exactly."""
    from triptych.sampling_params import SamplingParams
    from triptych.topology import InstanceType, Stage
    from triptych.worker.engine.request import PrefilledKV

    proc = processor(qwen2_vl_dir)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    held = to_request(proc, _case(QUESTIONS[1]), "held", params, stages={Stage.PREFILL})
    per_request = -(-(held.num_prompt_tokens + 1) // 16) + 1
    p = _engine(qwen2_vl_dir, role=InstanceType.P, block_size=16, num_kv_blocks=2 * per_request + 1)
    p.generate_batch([held])
    handoff = held.handoff
    assert held.status == RequestStatus.PARKED and p.kv.num_cached > 0
    snapshot = p.kv.tensor[handoff.kv_block_ids].clone()
    before = _counters(p)
    sharer = to_request(proc, _case(QUESTIONS[2]), "sharer", params, stages={Stage.PREFILL})
    p.generate_batch([sharer])  # hits the parked request's blocks
    assert _counters(p)["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert set(sharer.handoff.kv_block_ids) & set(handoff.kv_block_ids)
    p.release("sharer")
    for i in range(3):  # unrelated prompts: each allocation must evict unreferenced cached blocks
        other = to_request(proc, _case(QUESTIONS[3 + i], system=f"{i} " * 150), f"o{i}", params,
                           stages={Stage.PREFILL})
        p.generate_batch([other])
        assert other.status == RequestStatus.PARKED, other.error
        p.release(other.request_id)
        p.step()
    assert p.stats()["kv_cache"]["evicted"] > 0
    assert torch.equal(p.kv.tensor[handoff.kv_block_ids], snapshot)
    d = _engine(qwen2_vl_dir, role=InstanceType.D, block_size=16, num_kv_blocks=64)
    ids = d.reserve_kv(handoff.num_kv_tokens)
    d.kv.tensor[ids] = p.kv.tensor[handoff.kv_block_ids]
    dr = to_request(proc, _case(QUESTIONS[1]), "held", params, stages={Stage.DECODE},
                    prefilled=PrefilledKV(ids, handoff.num_kv_tokens, handoff.first_token))
    d.generate_batch([dr])
    assert tuple(dr.output_token_ids) == _hf(qwen2_vl_dir, QUESTIONS[1])
    p.release("held")
    p.step()
    _assert_no_leak(p)
    _assert_no_leak(d)


def test_a_hand_over_reserve_takes_the_cached_prefix_by_reference(qwen2_vl_dir: Path) -> None:
    """The decode side of a hand-over (`reserve_kv_cached`): the leading blocks the prefix
    cache holds come back first, referenced (not evictable); the rest are fresh. Named
    with `cache_kv`, pulled blocks are found by the next hand-over; no block leaks."""
    engine = _engine(qwen2_vl_dir, block_size=16, num_kv_blocks=64)
    first = _run(engine, qwen2_vl_dir, [(QUESTIONS[0], ())], "a")[0]
    ids, bs = first.prompt_token_ids, engine.kv.block_size
    hashes = engine.kv_block_hashes(ids, [], len(ids))
    assert hashes == block_hashes(ids, [], bs) and len(hashes) == len(ids) // bs
    cached = engine.kv.cached_prefix(hashes)
    assert len(cached) == len(hashes)  # the prefill named every full block
    blocks, held = engine.reserve_kv_cached(len(ids), hashes)
    assert held == len(hashes) and blocks[:held] == cached and len(blocks) == -(-len(ids) // bs)
    assert engine.stats()["kv_cache"]["used"] == len(blocks)  # referenced: none can be evicted now
    engine.free_kv(blocks)
    _assert_no_leak(engine)

    # Another prompt: nothing cached; once its blocks are named, a second reserve holds them.
    other = to_request(processor(qwen2_vl_dir), _case("x", system="Something else entirely. " * 8), "o")
    chain = engine.kv_block_hashes(other.prompt_token_ids, [], len(other.prompt_token_ids))
    blocks, held = engine.reserve_kv_cached(len(other.prompt_token_ids), chain)
    assert held == 0
    engine.cache_kv(blocks, chain)
    engine.free_kv(blocks)
    again, held = engine.reserve_kv_cached(len(other.prompt_token_ids), chain)
    assert held == len(chain) and again[:held] == blocks[:held]
    engine.free_kv(again)

    # No room for the rest: the references taken on the cached prefix are dropped again.
    with pytest.raises(OutOfBlocksError):
        engine.reserve_kv_cached(10_000 * bs, hashes)
    _assert_no_leak(engine)
