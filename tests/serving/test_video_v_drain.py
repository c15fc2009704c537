"""V instances over HTTP, real processes (2V1E1P1D): a video the encode instance already
holds the embedding of is not decoded again on the V instances (the router's cache
affinity places it on that E; the E uses its MM cache), and a V instance SIGTERM'd while
it decodes a request's GOP sets drains: it finishes them, keeps its parts until the E has
pulled them, hands the sets it had not taken to the other V instance, and exits. Greedy
tokens equal transformers `generate` (fp32) every time; no request is retried."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
import servekit
from servekit import tiny_dir
from videokit import VideoCase, clip, expected_ids

from triptych.worker.video_instance import SEGMENT_DELAY_ENV

pytestmark = pytest.mark.slow

FAMILY = "qwen2-vl"
DRAIN_TIMEOUT_S = 60.0  # the worker's default drain deadline (settings.drain_timeout_s)


@dataclass
class LongCase(VideoCase):
    """120 frames (10 GOPs): more GOP sets than the two V instances' four slots."""

    @property
    def video(self) -> bytes:
        return clip(self.seed, frames=120)


CACHED = VideoCase(seed=21, fps=7.0, with_image=False, stream=False)
DRAINED = LongCase(seed=22, fps=7.0, with_image=False, stream=True)


@functools.cache
def _expected_of(name: str) -> list[int]:
    return expected_ids(tiny_dir(FAMILY), {"cached": CACHED, "drained": DRAINED}[name])


def _expected(case: VideoCase) -> list[int]:
    return _expected_of("cached" if case is CACHED else "drained")


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory):
    # Every GOP set takes a second on a V instance: the drain test catches one mid-decode.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SEGMENT_DELAY_ENV, "1.0")
        with servekit.start(tiny_dir(FAMILY), "2V1E1P1D", tmp_path_factory.mktemp("v-drain")) as d:
            mp.delenv(SEGMENT_DELAY_ENV)
            yield d


def _v_segments(d) -> dict[str, int]:
    stats = servekit.stats_of(d)
    return {name: s["segments"] for name, s in stats.items() if name.startswith("worker-V-")}


def _retried(d) -> float:
    return servekit.metric_sum(d.router_url, "triptych_frontend_routing_decisions_total", outcome="retried")


def _one(d, case: VideoCase) -> dict:
    (got,) = asyncio.run(servekit.run_all(d.router_url, [case.openai_body(tiny_dir(FAMILY).name)]))
    return got


def test_cached_video_is_not_decoded_again(dep) -> None:
    encoder = servekit.worker(dep, "E")
    hits0 = servekit.stats_of(dep)["worker-E-0"]["counters"]["mm_cache_hits"]
    first = _one(dep, CACHED)
    assert first["status"] == 200 and first["token_ids"] == _expected(CACHED), first
    after_first = _v_segments(dep)
    assert sum(after_first.values()) > 0  # decoded on the V instances, once
    assert servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="v") == 1
    second = _one(dep, CACHED)
    assert second["status"] == 200 and second["token_ids"] == _expected(CACHED), second
    assert _v_segments(dep) == after_first  # no GOP set decoded for the second request
    assert servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="v") == 1
    assert servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="encoder") == 0
    stats = servekit.wait_idle(dep)
    assert stats["worker-E-0"]["counters"]["mm_cache_hits"] == hits0 + 1  # the E used its cached embedding
    servekit.assert_no_leaks(stats)


def test_sigterm_v_mid_request_drains_and_the_request_completes(dep) -> None:
    victim, survivor = servekit.worker(dep, "V", 0), servekit.worker(dep, "V", 1)
    encoder = servekit.worker(dep, "E")
    retried0 = _retried(dep)
    survivor0 = _v_segments(dep)[survivor.name]
    caught: dict = {}

    def terminate_when_decoding() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = httpx.get(f"{victim.url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
            if s["accepted"] > 0:
                caught.update(s)
                break
            time.sleep(0.02)
        os.killpg(victim.popen.pid, signal.SIGTERM)
        caught["rc"] = victim.popen.wait(DRAIN_TIMEOUT_S + 15)  # TimeoutExpired: it did not exit

    async def run() -> dict:
        task = asyncio.ensure_future(servekit.run_all(dep.router_url, [DRAINED.openai_body(tiny_dir(FAMILY).name)]))
        await asyncio.to_thread(terminate_when_decoding)
        return (await task)[0]

    got = asyncio.run(run())
    assert caught.get("accepted", 0) > 0, "the V instance was not caught decoding"
    assert got["status"] == 200 and not got.get("error"), got
    assert got["token_ids"] == _expected(DRAINED)
    # It exited by itself once drained (uvicorn re-raises the signal it caught after its
    # graceful shutdown: -SIGTERM is that exit, not a kill), having logged the drain.
    assert caught["rc"] in (0, -signal.SIGTERM)
    assert "drained:" in (dep.log_dir / f"{victim.name}.log").read_text()
    assert _retried(dep) == retried0  # no attempt failed: the E pulled the draining V's parts
    assert servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="encoder") == 0
    stats = servekit.wait_idle(dep, skip=[victim.name])
    assert stats[survivor.name]["segments"] > survivor0  # it decoded GOP sets of the request too
    servekit.assert_no_leaks(stats)
