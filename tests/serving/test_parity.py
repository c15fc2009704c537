"""Greedy completions over HTTP through real router and worker processes (NIXL between
them, `--transfer-require nixl`) equal transformers `generate()` on the same inputs."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import httpx
import pytest
import servekit
from servekit import tiny_dir

pytestmark = pytest.mark.slow

TOPOLOGIES = ["EPD", "1E1P1D", "2E1P2D"]
FAMILIES = ["qwen2-vl", "llava"]


@functools.cache
def _expected(family: str) -> tuple[list[servekit.Case], list[list[int]]]:
    model = tiny_dir(family)
    cases = servekit.make_cases(16)
    return cases, [servekit.expected_ids(model, c) for c in cases]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_greedy_parity_over_http(family: str, topology: str, tmp_path: Path) -> None:
    model = tiny_dir(family)
    cases, expected = _expected(family)
    with servekit.start(model, topology, tmp_path) as dep:
        results = asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(model.name) for c in cases]))
        worker_stats = servekit.stats_of(dep)
        worker_metrics = {w.name: httpx.get(f"{w.url}/metrics", timeout=10).text for w in dep.workers}
    for case, want, got in zip(cases, expected, results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case.index, got)
        assert got["token_ids"] == want, f"request {case.index} ({len(case.images)} images, stream={case.stream})"
    decoders = {n: s for n, s in worker_stats.items() if s["role"] == "D"}
    for name, s in decoders.items():
        assert s["counters"]["prefill_tokens"] == 0, f"{name} computed prefill tokens"
        assert s["counters"]["decode_tokens"] > 0
    moved = {n: sum(s["transfer_bytes"].values()) for n, s in worker_stats.items()}
    assert all(set(s["transfer_bytes"]) <= {"nixl-ucx"} for s in worker_stats.values())
    mm_bytes, kv_bytes = servekit.expected_transfer_bytes(model, [c for c, w in zip(cases, expected, strict=True)
                                                                   if len(w) > 1], worker_stats)
    mm_all, _ = servekit.expected_transfer_bytes(model, cases, worker_stats)
    if topology == "EPD":
        assert sum(moved.values()) == 0
    else:
        pulled_by_p = sum(moved[n] for n, s in worker_stats.items() if s["role"] == "P")
        pulled_by_d = sum(moved[n] for n in decoders)
        assert pulled_by_p == mm_all
        # A D takes the leading blocks its prefix cache holds (prompts sharing a chat
        # template's first blocks) instead of pulling them: exactly those are not moved.
        reused = sum(servekit.metric_in(worker_metrics[n], "triptych_worker_kv_blocks_reused_total") for n in decoders)
        block_size = next(iter(decoders.values()))["kv_cache"]["block_size"]
        assert pulled_by_d == kv_bytes - int(reused) * servekit.kv_block_nbytes(model, block_size)
    # The latency breakdown (HydraInfer §5.5) is on each instance's /metrics.
    for name, s in worker_stats.items():
        text = worker_metrics[name]
        for stage in ("encode", "prefill", "decode"):
            if stage[0].upper() in s["role"]:
                assert f'phase="exec",role="{s["role"]}",stage="{stage}"' in text, (name, stage)
                for field in ("requests", "tokens", "images"):  # all served: every queue empty
                    assert f'triptych_worker_queued_{field}{{instance="{s["instance_id"]}",role="{s["role"]}",' \
                           f'stage="{stage}"}} 0.0' in text, (name, stage, field)
        if s["role"] == "D":
            assert 'triptych_worker_migration_seconds_count{kind="pd",transport="nixl-ucx"}' in text
        if s["role"] == "P":
            assert 'triptych_worker_migration_seconds_count{kind="ep",transport="nixl-ucx"}' in text
    for name, s in worker_stats.items():
        assert s["kv_cache"]["used"] == 0 if "kv_cache" in s else True, name
        assert s["leases_outstanding"] == 0, name
