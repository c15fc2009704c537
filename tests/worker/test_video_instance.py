"""The V instance in-process: a GOP set decoded and patchified into its registered buffer,
pulled by an encode-side `VideoPuller` over the transfer engine; the rows equal the plain
sequential decode's patches bit for bit, the lease ends on the pull's confirmation; bad
input is refused with the right status and the instance keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

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
from triptych.worker.video import index_video, plan_segments, video_id
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
