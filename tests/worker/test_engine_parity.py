"""Exact greedy parity (fp32) with transformers `generate()` run per request (batch 1):
8 concurrent requests with 0-3 images each, through chunked prefill with chunk boundaries
inside image spans, block sizes 16 and 1 with scrambled (non-contiguous) block tables, and
a KV cache small enough to force preemption with recompute."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
from engine_cases import make_cases, processor, to_request
from hf_reference import hf_generate

from triptych.worker.engine import Engine, EngineConfig, RequestStatus
from triptych.worker.engine.batch import ScheduledBatch
from triptych.worker.engine.kv_cache import blocks_for

MAX_TOKENS = 10
CASES = make_cases(8)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


@lru_cache(maxsize=4)
def _reference(model_dir: Path) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(hf_generate(model_dir, c.messages, c.images, MAX_TOKENS)) for c in CASES)


@dataclass
class Span:
    request_id: str
    start: int
    end: int
    decode: bool
    block_ids: list[int]
    mm_spans: list[tuple[int, int]]


def _run(model_dir: Path, **config) -> tuple[Engine, list, list[list[Span]]]:
    engine = Engine(EngineConfig(model=str(model_dir), shuffle_seed=3, **config))
    proc = processor(model_dir)
    reqs = [to_request(proc, c, f"r{i}") for i, c in enumerate(CASES)]
    batches: list[list[Span]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> ScheduledBatch:  # observe the real scheduler's decisions
        batch = schedule()
        batches.append([Span(c.req.request_id, c.start, c.end, c.req.prefill_done, list(c.req.block_ids),
                             [(it.offset, it.offset + it.length) for it in c.req.mm_items]) for c in batch.chunks])
        return batch

    engine.scheduler.schedule = recording_schedule
    engine.generate_batch(reqs)
    return engine, reqs, batches


def _assert_parity(model_dir: Path, reqs: list) -> None:
    expected = _reference(model_dir)
    for req, ref in zip(reqs, expected, strict=True):
        assert req.status == RequestStatus.FINISHED and req.error is None
        assert tuple(req.output_token_ids) == ref, req.request_id


def _cut_inside_image(batches: list[list[Span]]) -> bool:
    return any(lo < s.end < hi for b in batches for s in b if not s.decode for lo, hi in s.mm_spans)


def _scrambled(batches: list[list[Span]]) -> bool:
    """Some request held blocks that were not consecutive ascending ids."""
    tables = [s.block_ids for b in batches for s in b]
    return any(t != list(range(t[0], t[0] + len(t))) for t in tables if len(t) > 1)


def test_chunked_prefill_with_boundaries_inside_images(tiny_model_dir: Path) -> None:
    engine, reqs, batches = _run(tiny_model_dir, block_size=16, num_kv_blocks=64, token_budget=13)
    _assert_parity(tiny_model_dir, reqs)
    counters = engine.stats()["counters"]
    assert counters["prefill_chunks"] > len(reqs)  # prompts were split
    assert max(r.num_prompt_tokens for r in reqs) > 13
    assert _cut_inside_image(batches)
    assert counters["images_encoded"] == sum(len(c.images) for c in CASES)
    # Decodes of several requests shared one forward with prefill chunks.
    assert any(sum(s.decode for s in b) >= 2 and not all(s.decode for s in b) for b in batches)
    assert engine.stats()["kv_cache"]["used"] == 0


def test_block_size_one_scrambled_blocks(tiny_model_dir: Path) -> None:
    engine, reqs, batches = _run(tiny_model_dir, block_size=1, num_kv_blocks=2048, token_budget=64)
    _assert_parity(tiny_model_dir, reqs)
    assert _scrambled(batches)


def test_preemption_with_recompute(tiny_model_dir: Path) -> None:
    proc = processor(tiny_model_dir)
    longest = max(len(proc.process(c.messages, c.images).token_ids) for c in CASES) + MAX_TOKENS
    blocks = blocks_for(longest, 4) + 4  # the longest request fits; two or three at a time do not
    engine, reqs, batches = _run(tiny_model_dir, block_size=4, num_kv_blocks=blocks, token_budget=32)
    _assert_parity(tiny_model_dir, reqs)
    counters = engine.stats()["counters"]
    assert counters["preemptions"] > 0
    assert any(r.num_preemptions > 0 and len(r.output_token_ids) > 1 for r in reqs)
    assert _scrambled(batches)
    assert engine.stats()["kv_cache"]["used"] == 0
