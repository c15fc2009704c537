"""Video requests over HTTP through real router and worker processes: greedy tokens equal
transformers `generate` (fp32) for video_url parts, alone and with an image, streamed and
not, through EPD and 1E1P1D (the embedding migrates E -> P over NIXL like an image's); the
encode instance decodes the video itself (no V instance) and counts it; bad videos are a
400 with an OpenAI error body and the deployment keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import servekit
from servekit import tiny_dir
from videokit import SERVING_CASES, bad_video_body, serving_expected

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2-vl", "qwen2.5-vl"]
TOPOLOGIES = ["EPD", "1E1P1D"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_video_greedy_parity_over_http(family: str, topology: str, tmp_path: Path) -> None:
    model = tiny_dir(family)
    expected = serving_expected(family)
    good = SERVING_CASES[0].video
    bad = [good[: len(good) // 2], b"not a video at all " * 40, b"\x89PNG\r\n\x1a\n" + b"\0" * 64]
    with servekit.start(model, topology, tmp_path) as dep:
        results = asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(model.name) for c in SERVING_CASES]))
        refused = asyncio.run(servekit.run_all(dep.router_url, [bad_video_body(model.name, b) for b in bad]))
        again = asyncio.run(servekit.run_all(dep.router_url, [SERVING_CASES[1].openai_body(model.name)]))
        encoder = servekit.worker(dep, "EPD" if topology == "EPD" else "E")
        decoded = servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="encoder")
        worker_stats = servekit.wait_idle(dep)
    for case, want, got in zip(SERVING_CASES, expected, results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case, got)
        assert len(want) > 0 and got["token_ids"] == want, case
    for got in refused:
        assert got["status"] == 400 and got["error"]["type"] == "invalid_request_error", got
        assert got["error"]["code"] in ("invalid_video", "unsupported_video_codec"), got
        assert got["error"]["param"] == "messages[0].content[0].video_url"
    assert again[0]["status"] == 200 and again[0]["token_ids"] == expected[1]
    # Each distinct video decoded once on the encoder: the repeat goes (by cache affinity)
    # to the encoder that holds its embedding, which uses it and does not decode again.
    assert decoded == len(SERVING_CASES)
    if topology != "EPD":
        pulled = sum(sum(s["transfer_bytes"].values()) for s in worker_stats.values() if s["role"] == "P")
        assert pulled > 0  # video (and image) embeddings migrated E -> P
    servekit.assert_no_leaks(worker_stats)
