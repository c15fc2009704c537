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

A V instance's 400 (a video that demuxed but does not decode) is the client's 400; its
503 `draining` (it is shutting down, worker/video_instance.py) moves the GOP sets it has
not taken to the plan's other V instances; any other failure is a `StageFailure` of that
V instance (the orchestrator retries without it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from triptych.router.backend import BackendError
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.videos import video_model
from triptych.stage_protocol import VIDEO_DRAINING, MMItemSpec, VideoPart, VideoSegmentRequest
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
        """Decode one video over `instances`; its parts in segment order. A V instance that
        drains meanwhile (503 `draining`: shut down) keeps the sets it is decoding; the
        sets it refuses go back in the queue for the others."""
        segments = await asyncio.to_thread(self.plan, data, item, len(instances) * self.slots_per_instance)
        self.queued_gop_sets += len(segments)
        run: _Run | None = None
        try:
            run = self._start(request_id, data, item, segments, instances)
            return await self._run(run, instances)
        finally:  # what a failure or cancellation left undecoded
            self.queued_gop_sets -= len(segments) - (run.decoded if run else 0)

    @staticmethod
    def _start(request_id: str, data: bytes, item: MMItemSpec, segments: list[Segment],
               instances: list[Instance]) -> _Run:
        queue: asyncio.Queue[Segment] = asyncio.Queue()
        for seg in segments:
            queue.put_nowait(seg)
        return _Run(request_id, data, item, segments[0].video_id, queue,
                    {inst.url: asyncio.Lock() for inst in instances})

    async def _run(self, run: _Run, instances: list[Instance]) -> list[VideoPart]:
        queue = run.queue
        live = list(instances)
        while True:
            tasks = [asyncio.create_task(self._slot(run, inst)) for inst in live for _ in range(self.slots_per_instance)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
            if queue.empty():
                return sorted(run.parts, key=lambda p: p.index)
            gone = [inst for inst in live if inst.url in run.draining]
            live = [inst for inst in live if inst.url not in run.draining]
            if not live:
                raise StageFailure(gone[0], "every V instance of the plan is draining", status=503)
            log.info("request %s: %d GOP sets move off draining V instance(s) %s", run.request_id, queue.qsize(),
                     [i.url for i in gone])

    async def _upload(self, run: _Run, inst: Instance, again: bool = False) -> None:
        async with run.uploads[inst.url]:
            if inst.url in run.uploaded and not again:
                return
            resp = await self._call(inst, "PUT", f"/internal/video/{run.video_id}", content=run.data)
            if _is_draining(resp):
                raise _Draining
            if resp.status_code != 204:
                raise StageFailure(inst, f"{inst.url} refused the video upload ({resp.status_code})", status=502)
            run.uploaded.add(inst.url)

    async def _slot(self, run: _Run, inst: Instance) -> None:
        """One decoder slot: takes the next GOP set whichever slot frees first (Alg. 2)."""
        while not run.queue.empty() and inst.url not in run.draining:
            seg = run.queue.get_nowait()
            try:
                resp = await self._decode_one(run, inst, seg)
            except _Draining:
                run.queue.put_nowait(seg)  # another V instance takes it
                run.draining.add(inst.url)
                inst.draining = True  # out of rotation now, not at its next probe
                return
            if resp.status_code == 400:
                raise BackendError(400, _message(resp), code="invalid_video")
            if resp.status_code != 200:
                raise StageFailure(inst, f"{inst.url} answered {resp.status_code} to a video segment: "
                                         f"{_message(resp)}", status=503 if resp.status_code == 503 else 502)
            run.parts.append(VideoPart.model_validate_json(resp.content))
            self.queued_gop_sets -= 1
            run.decoded += 1

    async def _decode_one(self, run: _Run, inst: Instance, seg: Segment) -> httpx.Response:
        await self._upload(run, inst)
        body = VideoSegmentRequest(request_id=run.request_id, video_id=run.video_id,
                                   segment=seg.model_dump(mode="json"),
                                   options=run.item.video or {}).model_dump_json()
        resp = await self._segment(inst, body)
        if resp.status_code == 404:  # evicted from its store: send the bytes again, once
            await self._upload(run, inst, again=True)
            resp = await self._segment(inst, body)
        if _is_draining(resp):
            raise _Draining
        return resp

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


@dataclass
class _Run:
    """One video's decode over the plan's V instances."""

    request_id: str
    data: bytes
    item: MMItemSpec
    video_id: str
    queue: asyncio.Queue[Segment]
    uploads: dict[str, asyncio.Lock]  # one upload at a time per instance
    uploaded: set[str] = field(default_factory=set)
    draining: set[str] = field(default_factory=set)  # instances that answered 503 `draining`
    parts: list[VideoPart] = field(default_factory=list)
    decoded: int = 0  # GOP sets answered (each left the dispatcher's queued_gop_sets then)


class _Draining(Exception):
    """The V instance is shutting down: it took nothing of this call."""


def _is_draining(resp: httpx.Response) -> bool:
    if resp.status_code != 503:
        return False
    try:
        return resp.json()["error"]["code"] == VIDEO_DRAINING
    except (ValueError, KeyError, TypeError):
        return False


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]
