"""Sends a request's videos to the plan's V instances, GOP set by GOP set.

FlashCodec (paper 000 §3) decodes one video collaboratively: Alg. 1 splits the sampled
frames into GOP-aligned segments, each but the last a multiple of the temporal patch size
(Fig. 7b: no temporal patch straddles two decoders); Alg. 2 schedules them stall-free at
GOP-set granularity. Here the decoders are the V instances' decoder threads: the router
plans the segments (demux only, as it did to count the tokens), uploads the video once to
each V instance that takes a segment, and runs `slots_per_instance` request slots per V
instance over one shared queue, so a free slot takes the next GOP set whichever instance
it is on. Each V instance answers a `VideoPart` (a handle on its video buffer); the
encode instance pulls the parts (worker/video_pull.py) instead of the bytes.

A V instance's 400 (a video that demuxed but does not decode) is the client's 400; any
other failure is a `StageFailure` of that V instance (the orchestrator retries without it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from triptych.router.backend import BackendError
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.videos import video_model
from triptych.stage_protocol import MMItemSpec, VideoPart, VideoSegmentRequest
from triptych.worker.video import (
    SamplingOptions,
    Segment,
    index_video,
    plan_segments,
    sample_frame_indices,
    video_id,
)

log = logging.getLogger("triptych.router.video_decode")


@dataclass
class VideoDispatcher:
    client: httpx.AsyncClient
    model_dir: str
    slots_per_instance: int = 2  # a V instance's decoder threads (worker decode_threads)
    segments_per_slot: int = 2  # GOP sets per slot: finer sets balance better, cost a seek each
    timeout_s: float = 120.0
    # GOP sets planned and not yet decoded (waiting for a slot or decoding), over every
    # video in flight: `triptych_frontend_video_queued_gop_sets`, the planner's V signal.
    queued_gop_sets: int = 0

    def plan(self, data: bytes, item: MMItemSpec, num_slots: int) -> list[Segment]:
        """The video's GOP sets (Alg. 1), exactly the frames the router counted. CPU work: a thread."""
        model = video_model(self.model_dir)
        if model is None:
            raise BackendError(400, "this model takes no video input", code="unsupported_content")
        cfg = model.config
        options = item.video.sampling() if item.video is not None else {}
        sampling = SamplingOptions.from_request(options, cfg.sampling_defaults())
        index = index_video(data)
        frames = sample_frame_indices(index.total_num_frames, index.fps, cfg.temporal_patch_size, sampling)
        return plan_segments(index, frames, cfg.temporal_patch_size, max(1, num_slots * self.segments_per_slot),
                             video_id(data))

    async def decode(self, request_id: str, data: bytes, item: MMItemSpec,
                     instances: list[Instance]) -> list[VideoPart]:
        """Decode one video over `instances`; its parts in segment order."""
        slots = [inst for inst in instances for _ in range(self.slots_per_instance)]
        segments = await asyncio.to_thread(self.plan, data, item, len(slots))
        self.queued_gop_sets += len(segments)
        decoded = [0]  # this video's GOP sets answered (each left queued_gop_sets then)
        try:
            return await self._decode(request_id, data, item, instances, slots, segments, decoded)
        finally:  # what a failure or cancellation left undecoded
            self.queued_gop_sets -= len(segments) - decoded[0]

    async def _decode(self, request_id: str, data: bytes, item: MMItemSpec, instances: list[Instance],
                      slots: list[Instance], segments: list[Segment], decoded: list[int]) -> list[VideoPart]:
        queue: asyncio.Queue[Segment] = asyncio.Queue()
        for seg in segments:
            queue.put_nowait(seg)
        uploads = {inst.url: asyncio.Lock() for inst in instances}
        uploaded: set[str] = set()
        parts: list[VideoPart] = []
        vid = segments[0].video_id

        async def upload(inst: Instance, again: bool = False) -> None:
            async with uploads[inst.url]:
                if inst.url in uploaded and not again:
                    return
                resp = await self._call(inst, "PUT", f"/internal/video/{vid}", content=data)
                if resp.status_code != 204:
                    raise StageFailure(inst, f"{inst.url} refused the video upload ({resp.status_code})", status=502)
                uploaded.add(inst.url)

        async def slot(inst: Instance) -> None:
            while not queue.empty():
                seg = queue.get_nowait()
                await upload(inst)
                body = VideoSegmentRequest(request_id=request_id, video_id=vid, segment=seg.model_dump(mode="json"),
                                           options=item.video or {}).model_dump_json()
                resp = await self._segment(inst, body)
                if resp.status_code == 404:  # evicted from its store: send the bytes again, once
                    await upload(inst, again=True)
                    resp = await self._segment(inst, body)
                if resp.status_code == 400:
                    raise BackendError(400, _message(resp), code="invalid_video")
                if resp.status_code != 200:
                    raise StageFailure(inst, f"{inst.url} answered {resp.status_code} to a video segment: "
                                             f"{_message(resp)}", status=503 if resp.status_code == 503 else 502)
                parts.append(VideoPart.model_validate_json(resp.content))
                self.queued_gop_sets -= 1
                decoded[0] += 1

        tasks = [asyncio.create_task(slot(inst)) for inst in slots]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return sorted(parts, key=lambda p: p.index)

    async def _segment(self, inst: Instance, body: str) -> httpx.Response:
        return await self._call(inst, "POST", "/internal/video/segment", content=body,
                                headers={"content-type": "application/json"})

    async def _call(self, inst: Instance, method: str, path: str, **kwargs: object) -> httpx.Response:
        inst.inflight += 1
        try:
            return await self.client.request(method, f"{inst.url}{path}", timeout=self.timeout_s, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise StageFailure(inst, f"{inst.url} failed a video call: {type(exc).__name__}",
                               status=503 if isinstance(exc, httpx.ConnectError) else 502) from exc
        finally:
            inst.inflight -= 1


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]
