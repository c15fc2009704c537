"""The router's `triptych_frontend_video_queued_gop_sets` (the planner's V-scaling signal):
GOP sets planned and not yet decoded, back to 0 when the decode ends, failed or not."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from videokit import clip

from triptych.router.backend import BackendError
from triptych.router.registry import Instance
from triptych.router.video_decode import VideoDispatcher
from triptych.stage_protocol import MMItemSpec
from triptych.worker.video import index_video, plan_segments, video_id


def test_queued_gop_sets_count_while_decoding_and_drop_after() -> None:
    data = clip(6)
    index = index_video(data)
    segments = plan_segments(index, list(range(0, index.total_num_frames, 3)), 2, 4, video_id(data))
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            return httpx.Response(204)
        seen.append(dispatcher.queued_gop_sets)
        return httpx.Response(400, json={"error": {"message": "does not decode"}})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            dispatcher.client = client
            with pytest.raises(BackendError):
                await dispatcher.decode("r1", data, MMItemSpec.model_construct(video=None),
                                        [Instance(url="http://v0", ready=True)])

    dispatcher = VideoDispatcher(client=None, model_dir="unused", slots_per_instance=1)  # type: ignore[arg-type]
    dispatcher.plan = lambda *_: segments  # type: ignore[method-assign]
    asyncio.run(run())
    assert seen and seen[0] == len(segments) == 4  # every planned GOP set counts until decoded
    assert dispatcher.queued_gop_sets == 0  # and none is left over after a failure
