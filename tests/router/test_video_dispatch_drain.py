"""The router's video dispatcher with a V instance that starts draining mid-video: the GOP
set it refuses with a 503 `draining` goes back in the queue and the other V instance
decodes it (a second round if its slots had finished); every set comes back once, in
order. Every V draining fails the stage over (a 503 StageFailure); a 503 without the
`draining` code is still a failure of that instance. The V instances are a mock
transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from videokit import clip

from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.video_decode import VideoDispatcher
from triptych.stage_protocol import MMItemSpec, VideoOptions
from triptych.tiny_model import tiny_model_path
from triptych.topology import InstanceType
from triptych.worker.video import Segment, video_id

MODEL = tiny_model_path("qwen2-vl")
A, B = "http://v-a", "http://v-b"


def _item(data: bytes) -> MMItemSpec:
    return MMItemSpec(kind="video", content_hash=video_id(data), offset=0, length=1,
                      video=VideoOptions(fps=24.0))


class FakeVs:
    """Two V instances: `drain_after[url]` segments answered, then 503 `draining` (or `code`)."""

    def __init__(self, drain_after: dict[str, int], code: str = "draining") -> None:
        self.drain_after, self.code = drain_after, code
        self.decoded: dict[str, list[int]] = {A: [], B: []}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if request.method == "PUT":
            return httpx.Response(204)
        if len(self.decoded[url]) >= self.drain_after.get(url, 1 << 30):
            return httpx.Response(503, json={"error": {"message": "draining", "code": self.code}})
        seg = Segment.model_validate(json.loads(request.content)["segment"])
        self.decoded[url].append(seg.index)
        n = len(seg.frame_indices)
        return httpx.Response(200, json={"index": seg.index, "num_frames": n, "rows": n * 8,
                                         "grid_thw": [n // 2, 2, 4], "handle": {"from": url}})


def _decode(fake: FakeVs, data: bytes) -> tuple[list, list[Instance]]:
    insts = [Instance(A, role=InstanceType.V, ready=True), Instance(B, role=InstanceType.V, ready=True)]

    async def run() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
            dispatcher = VideoDispatcher(client, str(MODEL))
            return await dispatcher.decode("r1", data, _item(data), insts)

    return asyncio.run(run()), insts


def test_sets_refused_by_a_draining_v_go_to_the_other() -> None:
    data = clip(5, frames=120)
    fake = FakeVs({A: 1})
    parts, insts = _decode(fake, data)
    assert [p.index for p in parts] == list(range(len(parts))) and len(parts) > 4
    assert len(fake.decoded[A]) == 1 and sorted(fake.decoded[A] + fake.decoded[B]) == list(range(len(parts)))
    assert insts[0].draining and not insts[1].draining  # out of rotation before its next probe


def test_every_v_draining_fails_the_stage_over() -> None:
    fake = FakeVs({A: 0, B: 1})
    with pytest.raises(StageFailure) as info:
        _decode(fake, clip(5, frames=120))
    assert info.value.status == 503 and "draining" in str(info.value)


def test_other_503s_are_a_failure_of_that_instance() -> None:
    fake = FakeVs({A: 0}, code="video_buffer_full")
    with pytest.raises(StageFailure) as info:
        _decode(fake, clip(5, frames=120))
    assert info.value.instance.url == A and info.value.status == 503
