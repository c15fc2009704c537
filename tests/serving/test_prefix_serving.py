"""Prefix caching and prefix-aware routing through real router and worker processes: two
aggregated instances; requests sharing a long system prompt land on the instance that
computed it and reuse its KV (exact greedy outputs), until it is loaded enough that the
other one is cheaper."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import servekit
from hf_reference import hf_generate
from servekit import tiny_dir

pytestmark = pytest.mark.slow

SYSTEM = "You answer in one short sentence and never use lists or numbers. " * 6


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {"role": "user", "content": [{"type": "text", "text": question}]}]


def _body(model: Path, question: str, max_tokens: int = 6) -> dict:
    return {"model": model.name, "messages": _messages(question), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def _counters(dep) -> dict[str, dict[str, int]]:
    return {n: s["counters"] for n, s in servekit.stats_of(dep).items()}


@pytest.fixture(scope="module")
def two_epd(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "2EPD", tmp_path_factory.mktemp("prefix")) as dep:
        yield model, dep


def test_shared_system_prompt_sticks_to_its_holder_and_reuses_its_kv(two_epd) -> None:
    model, dep = two_epd
    questions = ["hi", "what is rain", "name a bird", "why do cats purr"]
    results = []
    with httpx.Client(timeout=120) as client:
        for q in questions:  # one at a time: no load to balance against
            r = client.post(f"{dep.router_url}/v1/chat/completions", json=_body(model, q))
            assert r.status_code == 200, r.text
            results.append(r.json()["choices"][0]["token_ids"])
    for q, got in zip(questions, results, strict=True):
        assert got == hf_generate(model, _messages(q), [], 6), q
    counters = _counters(dep)
    holder = max(counters, key=lambda n: counters[n]["prefix_cache_queries"])
    others = [n for n in counters if n != holder]
    assert all(counters[n]["prefix_cache_queries"] == 0 for n in others), counters  # round robin would split
    assert counters[holder]["prefix_cache_hits"] >= 3 * 64  # each later request reused the system prompt
    worker = next(w for w in dep.workers if w.name == holder)
    assert servekit.metric_sum(worker.url, "triptych_worker_prefix_cache_hits_total") == \
        counters[holder]["prefix_cache_hits"]
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def test_a_burst_spills_over_to_the_other_instance_when_the_holder_is_loaded(two_epd) -> None:
    model, dep = two_epd
    before = _counters(dep)
    bodies = [_body(model, f"question number {i}: say something", max_tokens=24) for i in range(24)]
    results = asyncio.run(servekit.run_all(dep.router_url, bodies))
    assert all(r["status"] == 200 and not r.get("error") for r in results), results
    after = _counters(dep)
    served = {n: after[n]["prefix_cache_queries"] - before[n]["prefix_cache_queries"] for n in after}
    assert all(v > 0 for v in served.values()), served  # the holder's load sent some elsewhere
    hits = {n: after[n]["prefix_cache_hits"] - before[n]["prefix_cache_hits"] for n in after}
    assert all(v > 0 for v in hits.values()), hits  # and there too the prompt was then reused
    servekit.assert_no_leaks(servekit.wait_idle(dep))


# --- a decode instance skips the KV blocks it already holds ---------------------------------


@pytest.fixture(scope="module")
def ep_d(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "1EP1D", tmp_path_factory.mktemp("prefix-pd")) as dep:
        yield model, dep


def test_decode_pulls_only_the_blocks_its_prefix_cache_lacks(ep_d) -> None:
    from triptych.prefix_hash import block_hashes
    from triptych.processor import MultimodalProcessor

    model, dep = ep_d
    d = servekit.worker(dep, "D")
    block_size = servekit.stats_of(dep)[d.name]["kv_cache"]["block_size"]
    kv_block = servekit.kv_block_nbytes(model, block_size)
    proc = MultimodalProcessor.from_pretrained(model)
    questions = ["what is rain", "what is rain", "name a bird"]  # a repeat, then the same system prompt
    held_hashes: set[bytes] = set()  # what the D's prefix cache holds (nothing is evicted here)
    reused_before = servekit.metric_sum(d.url, "triptych_worker_kv_blocks_reused_total")
    expected_reused = 0
    with httpx.Client(timeout=120) as client:
        for q in questions:
            ids = proc.process(_messages(q), []).token_ids
            chain = block_hashes(ids, [], block_size)
            held = next((i for i, h in enumerate(chain) if h not in held_hashes), len(chain))
            before = servekit.metric_sum(d.url, "triptych_worker_transfer_bytes_total", region="kv")
            r = client.post(f"{dep.router_url}/v1/chat/completions", json=_body(model, q))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == hf_generate(model, _messages(q), [], 6), q
            pulled = servekit.metric_sum(d.url, "triptych_worker_transfer_bytes_total", region="kv") - before
            # Exactly the blocks the D lacked: all of them the first time, then past the shared prefix.
            assert pulled == (-(-len(ids) // block_size) - held) * kv_block, (q, len(ids), held)
            expected_reused += held
            held_hashes.update(chain)
    assert expected_reused >= len(SYSTEM) // 8 // block_size  # the repeats did skip blocks (a real test)
    reused = servekit.metric_sum(d.url, "triptych_worker_kv_blocks_reused_total") - reused_before
    assert reused == expected_reused
    servekit.assert_no_leaks(servekit.wait_idle(dep))
