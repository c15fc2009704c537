"""LLaVA serves video by taking the sampled frames as images, over HTTP with real router and
worker processes: greedy tokens equal transformers' fp32 `LlavaForConditionalGeneration`
fed the same sampled frames as a list of images (tests/videokit.py), streamed and not, with
and without an image in the same request, through EPD and 1E1P1D (the encode instance
decodes the video itself) and 1V1E1P1D (a V instance decodes, the encode instance pulls the
frames over NIXL). Bad videos are a 400 with an OpenAI error body and the deployment keeps
serving; a repeated video is not decoded again (its frames' embeddings are cached where the
router sends it). One deployment per topology, shared by the module's tests (CI has 2 cores)."""

from __future__ import annotations

import asyncio
import base64
import functools

import pytest
import servekit
from servekit import tiny_dir
from videokit import VideoCase, expected_ids, undecodable_clip

pytestmark = pytest.mark.slow

FAMILY = "llava"
TOPOLOGIES = ["EPD", "1E1P1D", "1V1E1P1D"]
CASES = [
    VideoCase(seed=3, fps=7.0, with_image=False, stream=True),  # 14 frames
    VideoCase(seed=4, fps=3.0, with_image=True, stream=False),  # 6 frames
    VideoCase(seed=5, fps=None, with_image=False, stream=False),  # the default 2 fps: 4 frames
    VideoCase(seed=6, fps=None, with_image=True, stream=True),
]


@functools.cache
def _expected() -> list[list[int]]:
    return [expected_ids(tiny_dir(FAMILY), c) for c in CASES]


@pytest.fixture(scope="module", params=TOPOLOGIES)
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    topology = request.param
    with servekit.start(tiny_dir(FAMILY), topology, tmp_path_factory.mktemp(f"llava-{topology}")) as dep:
        yield topology, dep


def _bad(model: str, data: bytes) -> dict:
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    return {"model": model, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
            "max_tokens": 4}


def _encoder(dep, topology: str):
    return servekit.worker(dep, "EPD" if topology == "EPD" else "E")


def test_llava_video_greedy_parity_over_http(deployment) -> None:
    topology, dep = deployment
    model = tiny_dir(FAMILY)
    results = asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(model.name) for c in CASES]))
    for case, want, got in zip(CASES, _expected(), results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case, got)
        assert len(want) > 0 and got["token_ids"] == want, case
    encoder = _encoder(dep, topology)
    by_v = servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="v")
    by_e = servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="encoder")
    # Each video decoded once, whatever its frame count: by the V instance where there is one.
    assert (by_v, by_e) == ((len(CASES), 0) if "V" in topology else (0, len(CASES)))
    stats = servekit.wait_idle(dep)
    if topology != "EPD":  # the frames' embeddings migrated E -> P (and V -> E the frames)
        assert sum(sum(s["transfer_bytes"].values()) for s in stats.values() if s["role"] == "P") > 0
    if "V" in topology:
        assert stats["worker-V-0"]["segments"] > 0
        assert stats["worker-E-0"]["transfer_bytes"].get("nixl-ucx", 0) > 0
    servekit.assert_no_leaks(stats)


def test_llava_bad_videos_are_400_and_serving_goes_on(deployment) -> None:
    topology, dep = deployment
    model = tiny_dir(FAMILY)
    good = CASES[0].video
    bad = [good[: len(good) // 2], b"not a video at all " * 40, undecodable_clip()]
    refused = asyncio.run(servekit.run_all(dep.router_url, [_bad(model.name, b) for b in bad]))
    for got in refused:
        assert got["status"] == 400 and got["error"]["type"] == "invalid_request_error", got
        assert got["error"]["code"] in ("invalid_video", "unsupported_video_codec"), got
    for got in refused[:2]:  # found by the router's demux
        assert got["error"]["param"] == "messages[0].content[0].video_url", got
    # Found only by decoding (the V instance's, else the encode instance's own decoder).
    assert "does not decode" in refused[-1]["error"]["message"], refused[-1]
    encoder = _encoder(dep, topology)

    def decoded() -> float:
        return sum(servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where=where)
                   for where in ("v", "encoder"))

    counts = [decoded()]
    for _ in range(2):
        again = asyncio.run(servekit.run_all(dep.router_url, [CASES[1].openai_body(model.name)]))
        assert again[0]["status"] == 200 and again[0]["token_ids"] == _expected()[1]
        counts.append(decoded())
    # A repeat goes (cache affinity by the video's key) to the encoder holding its frames'
    # embeddings: not decoded again, anywhere (the first may be new to this deployment).
    assert counts[2] == counts[1] and counts[1] - counts[0] in (0, 1), counts
    servekit.assert_no_leaks(servekit.wait_idle(dep))
