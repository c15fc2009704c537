"""Remote decoder slots (worker/video/remote.py) against real decoder services
(worker/video/service.py) on loopback: a video's GOP sets decoded across two services and
a local slot equal a plain sequential decode; each service gets the bytes once; an evicted
video is sent again; a bad video fails with a typed error and the services keep serving;
a wrong hash or an unknown video is refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import cache

import httpx
import numpy as np
import pytest
import uvicorn
from polling import wait_until

from triptych.http_ready import answers_ok
from triptych.local import free_port
from triptych.worker.video import (
    CollaborativeDecoder,
    CorruptVideoError,
    LocalSlot,
    SamplingOptions,
    index_video,
    sample_frame_indices,
    video_id,
)
from triptych.worker.video.remote import RemoteDecoderError, RemoteSlot
from triptych.worker.video.service import create_decoder_app
from triptych.worker.video.synthetic import make_clip, sequential_decode


@cache
def clip() -> bytes:
    return make_clip(61, codec="libx264", gop=8, b_frames=2)


@pytest.fixture(scope="module")
def services() -> Iterator[list[str]]:
    servers, urls = [], []
    for cache_bytes in (1 << 30, 1):  # the second keeps one video only
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_decoder_app(cache_bytes=cache_bytes), host="127.0.0.1",
                                               port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 20
    for url in urls:
        assert wait_until(lambda url=url: answers_ok(f"{url}/live", timeout_s=1),
                          max(0.0, deadline - time.monotonic()), interval_s=0.05), "decoder service did not start"
    yield urls
    for server in servers:
        server.should_exit = True


def test_remote_and_local_slots_equal_sequential_decode(services: list[str]) -> None:
    remotes = [RemoteSlot(url) for url in services]
    with CollaborativeDecoder(slots=[*remotes, LocalSlot()], segments_per_decoder=3) as pool:
        for fps in (6.0, 24.0):
            video = pool.decode(clip(), 2, SamplingOptions(fps=fps), timeout=60)
            assert len(video.segments) > 3
            assert np.array_equal(video.frames(), sequential_decode(clip())[video.frame_indices])
    assert all(r.uploads == 1 for r in remotes)  # bytes sent once per service, not per segment


def test_evicted_video_is_sent_again(services: list[str]) -> None:
    slot = RemoteSlot(services[1])  # holds one video at a time
    other = make_clip(16, codec="libx264", gop=8, b_frames=0, seed=9)
    with CollaborativeDecoder(slots=[slot]) as pool:
        pool.decode(clip(), 2, SamplingOptions(fps=6.0), timeout=60)
        pool.decode(other, 2, SamplingOptions(fps=6.0), timeout=60)  # evicts clip() there
        video = pool.decode(clip(), 2, SamplingOptions(fps=6.0), timeout=60)
    assert slot.uploads == 3
    assert np.array_equal(video.frames(), sequential_decode(clip())[video.frame_indices])


def test_undecodable_segment_fails_typed_and_services_keep_serving(services: list[str]) -> None:
    # A segment asking for frames the video does not have (planned on a longer clip): the
    # service's decoder runs out of frames -> its 400 -> CorruptVideoError here.
    longer = make_clip(200, codec="libx264", gop=8, b_frames=2, seed=4)
    with CollaborativeDecoder(num_decoders=1) as local:
        segment = local.plan(longer, index_video(longer), list(range(200)), 2)[-1]
    slot = RemoteSlot(services[0])
    with pytest.raises(CorruptVideoError, match="ended before"):
        slot.run(clip(), segment.model_copy(update={"video_id": video_id(clip())}))
    with CollaborativeDecoder(slots=[slot]) as pool:
        assert pool.decode(clip(), 2, SamplingOptions(fps=6.0), timeout=60).frame_indices


def test_service_refuses_wrong_hash_and_unknown_video(services: list[str]) -> None:
    url = services[0]
    assert httpx.put(f"{url}/internal/video/{'0' * 64}", content=clip()).status_code == 400
    with CollaborativeDecoder(num_decoders=1) as pool:
        index = index_video(clip())
        segment = pool.plan(clip(), index, sample_frame_indices(61, 24.0, 2, SamplingOptions(fps=6.0)), 2)[0]
    body = segment.model_copy(update={"video_id": "f" * 64}).model_dump_json()
    resp = httpx.post(f"{url}/internal/video/{'f' * 64}/segment", content=body,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 404 and "upload it first" in resp.json()["error"]["message"]
    with pytest.raises(RemoteDecoderError):
        RemoteSlot("http://127.0.0.1:9", timeout_s=2).run(clip(), segment.model_copy(
            update={"video_id": video_id(clip())}))
