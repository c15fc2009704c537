"""The V instance in-process: a GOP set decoded and patchified into its registered buffer,
pulled by an encode-side `VideoPuller` over the transfer engine; the rows equal the plain
sequential decode's patches bit for bit, the lease ends on the pull's confirmation; bad
input is refused with the right status and the instance keeps serving."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from polling import wait_until
from videokit import clip, undecodable_clip

from triptych.stage_protocol import VideoOptions, VideoPart, VideoSegmentRequest
from triptych.tiny_model import tiny_model_path
from triptych.video_processing import VideoProcessorConfig, preprocess_frames
from triptych.worker.auth import WorkerAuth
from triptych.worker.settings import WorkerSettings
from triptych.worker.transfer import TransferEngine
from triptych.worker.video import DecoderUnavailableError, index_video, plan_segments, video_id
from triptych.worker.video.synthetic import sequential_decode
from triptych.worker.video_instance import create_video_app
from triptych.worker.video_pull import VideoPuller

MODEL = tiny_model_path("qwen2-vl")


@pytest.fixture(scope="module")
def v_client() -> Iterator[TestClient]:
    settings = WorkerSettings(model=str(MODEL), role="V", instance_id="V-test", video_buffer_mb=8)
    with TestClient(create_video_app(settings, WorkerAuth.open())) as client:
        yield client


def _segments(data: bytes, n: int = 2):
    index = index_video(data)
    return plan_segments(index, list(range(0, index.total_num_frames, 3)), 2, n, video_id(data))


def _post(client: TestClient, data: bytes, seg, request_id: str = "r1"):
    body = VideoSegmentRequest(request_id=request_id, video_id=seg.video_id, segment=seg.model_dump(mode="json"),
                               options=VideoOptions())
    return client.post("/internal/video/segment", content=body.model_dump_json(),
                       headers={"content-type": "application/json"})


def test_parts_pulled_equal_a_sequential_decode(v_client: TestClient) -> None:
    data = clip(7)
    segs = _segments(data)
    assert len(segs) == 2
    assert v_client.put(f"/internal/video/{segs[0].video_id}", content=data).status_code == 204
    parts = []
    for seg in segs:
        r = _post(v_client, data, seg)
        assert r.status_code == 200, r.text
        parts.append(VideoPart.model_validate(r.json()))
    assert v_client.get("/admin/stats").json()["leases_outstanding"] == 2
    config = VideoProcessorConfig.from_pretrained(MODEL)
    frames = [f for s in segs for f in s.frame_indices]
    want = preprocess_frames(sequential_decode(data)[frames], config)
    patch_dim = want.pixel_values_videos.shape[1]
    with TransferEngine("e-test") as transfer:
        rows, grid = VideoPuller(8 << 20).pull(transfer, parts[::-1], patch_dim, timeout_s=10)  # any order
    assert grid == want.grid_thw
    assert (rows == want.pixel_values_videos).all()  # bit-identical
    wait_until(lambda: v_client.get("/admin/stats").json()["leases_outstanding"] == 0, timeout_s=10)
    stats = v_client.get("/admin/stats").json()
    assert stats["video_buffer_free"] == stats["video_buffer_blocks"]  # the confirmations freed the blocks


def test_bad_input_is_refused_and_the_instance_keeps_serving(v_client: TestClient) -> None:
    data, bad = clip(8), undecodable_clip(8)
    seg = _segments(data)[0]
    assert v_client.put(f"/internal/video/{seg.video_id}", content=bad).status_code == 400  # wrong hash
    assert _post(v_client, data, seg).status_code == 404  # not uploaded
    bad_seg = _segments(bad, 1)[0]  # the whole video: its garbage GOPs included
    assert v_client.put(f"/internal/video/{bad_seg.video_id}", content=bad).status_code == 204
    r = _post(v_client, bad, bad_seg)
    assert r.status_code == 400 and "does not decode" in r.json()["error"]["message"]
    assert v_client.put(f"/internal/video/{seg.video_id}", content=data).status_code == 204
    assert _post(v_client, data, seg, request_id="r2").status_code == 200
    # The router aborts the request: its leases end and the blocks are free again.
    assert v_client.post("/internal/abort/r2").json()["leases"] == 1
    stats = v_client.get("/admin/stats").json()
    assert stats["leases_outstanding"] == 0 and stats["video_buffer_free"] == stats["video_buffer_blocks"]
    assert stats["refused"] == 1


def test_role_is_fixed(v_client: TestClient) -> None:
    assert v_client.post("/admin/role", json={"role": "V"}).status_code == 200
    assert v_client.post("/admin/role", json={"role": "E"}).status_code == 409
    assert v_client.get("/health").json()["role"] == "V"


def _pull(parts: list[VideoPart], patch_dim: int):
    with TransferEngine("e-drain") as transfer:
        return VideoPuller(8 << 20).pull(transfer, parts, patch_dim, timeout_s=10)


def test_drain_finishes_held_parts_and_refuses_new_work() -> None:
    """SIGTERM's drain (worker/draining.py): /health says draining, new uploads and
    segments are a 503 `draining`, and the drain ends only once the part offered before it
    was pulled and confirmed (the lease is not dropped at the signal)."""
    settings = WorkerSettings(model=str(MODEL), role="V", instance_id="V-drain", video_buffer_mb=8,
                              drain_timeout_s=60)
    data = clip(9)
    seg, later = _segments(data)
    with TestClient(create_video_app(settings, WorkerAuth.open())) as client:
        inst = client.app.state.instance
        assert client.put(f"/internal/video/{seg.video_id}", content=data).status_code == 204
        r = _post(client, data, seg)
        assert r.status_code == 200, r.text
        part = VideoPart.model_validate(r.json())
        assert inst.begin_drain()
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["draining"] is True
        assert client.get("/ready").status_code == 503
        refused = _post(client, data, later)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert client.put(f"/internal/video/{seg.video_id}", content=data).json()["error"]["code"] == "draining"
        drained = threading.Thread(target=lambda: asyncio.run(inst.drain()), daemon=True)
        drained.start()
        drained.join(0.5)
        assert drained.is_alive()  # the offered part is still held for its puller
        config = VideoProcessorConfig.from_pretrained(MODEL)
        want = preprocess_frames(sequential_decode(data)[seg.frame_indices], config)
        rows, _grid = _pull([part], want.pixel_values_videos.shape[1])
        assert (rows == want.pixel_values_videos).all()
        drained.join(30)
        assert not drained.is_alive()
        stats = client.get("/admin/stats").json()
        assert stats["leases_outstanding"] == 0 and stats["draining"] is True and stats["segments"] == 1


def _nvdec_usable() -> str | None:
    """Why NVDEC cannot run here (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import PyNvVideoCodec  # noqa: F401
    except (ImportError, RuntimeError) as exc:
        return f"PyNvVideoCodec unavailable: {exc}"
    return None


@pytest.mark.parametrize("kind", ["auto", "pyav"])
def test_decoder_selection_falls_back_to_pyav(kind: str) -> None:
    why = _nvdec_usable()
    if kind == "auto" and why is None:
        pytest.skip("NVDEC is usable here: auto picks it (see the gpu test)")
    settings = WorkerSettings(model=str(MODEL), role="V", instance_id="V-sel", video_buffer_mb=1, video_decoder=kind)
    with TestClient(create_video_app(settings, WorkerAuth.open())) as client:
        stats = client.get("/admin/stats").json()
    assert stats["decoder"] == "pyav"
    if kind == "pyav":
        assert stats["decoder_reason"].startswith("pyav: forced")
    else:
        assert stats["decoder_reason"].startswith("pyav: auto") and (
            "no CUDA" in stats["decoder_reason"] or "NVDEC unavailable" in stats["decoder_reason"])


def test_forced_nvdec_without_it_does_not_start() -> None:
    if _nvdec_usable() is None:
        pytest.skip("NVDEC is usable here")
    settings = WorkerSettings(model=str(MODEL), role="V", instance_id="V-nv", video_buffer_mb=1, video_decoder="nvdec")
    with pytest.raises(DecoderUnavailableError), TestClient(create_video_app(settings, WorkerAuth.open())):
        pass


@pytest.mark.gpu
def test_nvdec_v_instance_parts_match_a_pyav_decode() -> None:
    why = _nvdec_usable()
    if why is not None:
        pytest.skip(why)
    settings = WorkerSettings(model=str(MODEL), role="V", instance_id="V-gpu", video_buffer_mb=8, device="cuda")
    data = clip(10)
    segs = _segments(data)
    with TestClient(create_video_app(settings, WorkerAuth.open())) as client:
        stats = client.get("/admin/stats").json()
        assert stats["decoder"] == "nvdec" and stats["decoder_reason"].startswith("nvdec: auto"), stats
        assert client.put(f"/internal/video/{segs[0].video_id}", content=data).status_code == 204
        parts = []
        for seg in segs:
            r = _post(client, data, seg, request_id="gpu")
            assert r.status_code == 200, r.text
            parts.append(VideoPart.model_validate(r.json()))
        config = VideoProcessorConfig.from_pretrained(MODEL)
        want = preprocess_frames(sequential_decode(data)[[f for s in segs for f in s.frame_indices]], config)
        rows, grid = _pull(parts, want.pixel_values_videos.shape[1])
    assert grid == want.grid_thw and rows.shape == want.pixel_values_videos.shape
    # NVDEC's NV12 converted as swscale converts (yuv.py): the same pixels, so the same patches.
    assert np.array_equal(rows, want.pixel_values_videos), float(np.abs(rows - want.pixel_values_videos).mean())


def test_parked_v_is_a_standby_that_still_decodes(v_client: TestClient) -> None:
    # the planner's V scaling (local): parked, /health says unassigned (the router picks it
    # for no new video) and marks it a video decoder; GOP sets sent to it still decode
    data = clip(9)
    seg = _segments(data)[0]
    assert v_client.put(f"/internal/video/{seg.video_id}", content=data).status_code == 204
    try:
        assert v_client.post("/admin/role", json={"role": "unassigned"}).status_code == 200
        health = v_client.get("/health").json()
        assert (health["role"], health["video"], health["status"]) == ("unassigned", True, "ok")
        r = _post(v_client, data, seg, request_id="r-parked")
        assert r.status_code == 200, r.text
    finally:
        assert v_client.post("/admin/role", json={"role": "V"}).status_code == 200
    assert v_client.get("/health").json()["role"] == "V"
    assert v_client.post("/admin/role", json={"role": "E"}).status_code == 409
