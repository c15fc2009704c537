"""Collaborative decoding of one video by several decoders, stall-free (paper 000 §3.2-3.4).

A video is demuxed once (`demux.index_video`), its sampled frames are planned into
GOP-aligned segments (`segments.plan_segments`, more segments than decoders), and the
segments — FlashCodec's GOP sets — are spread over the decoders. Scheduling is stall-free
at GOP-set granularity (§3.3, Alg. 2): no decoder is bound to a fixed share of a video; a
decoder that finishes a set takes the next one at once, from the request it just worked
on while that request has sets left (Alg. 2 lines 9-13: finish one request before
starting the next, which cuts its latency and the frames held in memory, §3.4), else from
the oldest request.

A decoder is a `DecoderSlot`: a thread here drives each slot, and a slot may run its
segment anywhere — `LocalSlot` decodes in this process with a backend from `decode.py`;
a slot that posts the segment (a pure description) to another V instance holding the
same bytes is the hook for multi-instance decoding (the integration adds it).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .decode import DecodedSegment, DecoderBackend, PyAVBackend
from .demux import VideoIndex, index_video
from .limits import VideoLimits
from .sampling import SamplingOptions, sample_frame_indices
from .segments import Segment, plan_segments

SEGMENTS_PER_DECODER = 4  # GOP sets per decoder: slack for stall-free balancing (§3.3)


class DecoderSlot(Protocol):
    """Runs one segment of one video to its frames (locally or on a remote V instance)."""

    def run(self, data: bytes, segment: Segment) -> DecodedSegment: ...


@dataclass
class LocalSlot:
    backend: DecoderBackend = field(default_factory=PyAVBackend)

    def run(self, data: bytes, segment: Segment) -> DecodedSegment:
        return self.backend.decode(data, segment)


@dataclass
class DecodedVideo:
    """The sampled frames of one video, kept per segment (each a multiple of the temporal
    patch size but the last, so the processor may patchify segment by segment)."""

    index: VideoIndex
    frame_indices: list[int]
    segments: list[DecodedSegment]

    def frames(self) -> np.ndarray:
        """All frames [n, H, W, 3] uint8 in one array (copies; PyAV segments only)."""
        return np.concatenate([np.asarray(s.frames) for s in self.segments])


@dataclass
class _Job:
    id: int
    data: bytes
    index: VideoIndex
    frame_indices: list[int]
    pending: deque[Segment]
    future: Future[DecodedVideo]
    done: dict[int, DecodedSegment] = field(default_factory=dict)
    total: int = 0


class CollaborativeDecoder:
    """A pool of decoder slots shared by all videos of this instance (see module docstring)."""

    def __init__(self, slots: Sequence[DecoderSlot] | None = None, num_decoders: int = 1,
                 segments_per_decoder: int = SEGMENTS_PER_DECODER) -> None:
        self.slots = list(slots) if slots else [LocalSlot() for _ in range(num_decoders)]
        self.segments_per_decoder = segments_per_decoder
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}  # insertion order = arrival order
        self._ids = itertools.count()
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, args=(slot,), name=f"video-decoder-{i}", daemon=True)
                         for i, slot in enumerate(self.slots)]
        for thread in self._threads:
            thread.start()

    @property
    def num_decoders(self) -> int:
        return len(self.slots)

    # -- submitting --

    def submit(self, data: bytes, index: VideoIndex, segments: Sequence[Segment]) -> Future[DecodedVideo]:
        """Queue an already planned video; the future resolves when every segment is decoded."""
        future: Future[DecodedVideo] = Future()
        frames = [i for s in segments for i in s.frame_indices]
        with self._cond:
            if self._closed:
                raise RuntimeError("the decoder pool is closed")
            job = _Job(next(self._ids), data, index, frames, deque(segments), future, total=len(segments))
            self._jobs[job.id] = job
            self._cond.notify_all()
        return future

    def plan(self, data: bytes, index: VideoIndex, frame_indices: Sequence[int],
             temporal_patch_size: int) -> list[Segment]:
        return plan_segments(index, frame_indices, temporal_patch_size,
                             self.num_decoders * self.segments_per_decoder, video_id=video_id(data))

    def decode(self, data: bytes, temporal_patch_size: int, options: SamplingOptions | None = None,
               limits: VideoLimits | None = None, timeout: float = 120.0) -> DecodedVideo:
        """Demux, sample (transformers' Qwen2-VL rule), plan and decode one video; blocks."""
        index = index_video(data, limits)
        frames = sample_frame_indices(index.total_num_frames, index.fps, temporal_patch_size, options)
        future = self.submit(data, index, self.plan(data, index, frames, temporal_patch_size))
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            self.cancel(future)
            raise

    def cancel(self, future: Future[DecodedVideo]) -> None:
        """Drop the queued segments of a video (running ones finish and are discarded)."""
        with self._cond:
            for job_id, job in list(self._jobs.items()):
                if job.future is future:
                    del self._jobs[job_id]
        future.cancel()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            for job in self._jobs.values():
                job.future.cancel()
            self._jobs.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def __enter__(self) -> CollaborativeDecoder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the decoder threads --

    def _next(self, last_job: int | None) -> tuple[_Job, Segment] | None:
        """Alg. 2: the same request's next GOP set first, else the oldest request's."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                job = self._jobs.get(last_job) if last_job is not None else None
                if job is None or not job.pending:
                    job = next((j for j in self._jobs.values() if j.pending), None)
                if job is not None:
                    return job, job.pending.popleft()
                self._cond.wait(timeout=1.0)

    def _worker(self, slot: DecoderSlot) -> None:
        last: int | None = None
        while (work := self._next(last)) is not None:
            job, segment = work
            last = job.id
            try:
                result = slot.run(job.data, segment)
            except Exception as exc:  # any failure fails that video, not the pool
                self._fail(job, exc)
                continue
            self._finish(job, result)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        with self._cond:
            self._jobs.pop(job.id, None)
            job.pending.clear()
        _settle(job.future, exc=exc)

    def _finish(self, job: _Job, result: DecodedSegment) -> None:
        with self._cond:
            job.done[result.segment] = result
            complete = len(job.done) == job.total and job.id in self._jobs
            if complete:
                del self._jobs[job.id]
        if complete:
            segments = [job.done[i] for i in sorted(job.done)]
            _settle(job.future, DecodedVideo(job.index, job.frame_indices, segments))


def _settle(future: Future[DecodedVideo], result: DecodedVideo | None = None,
            exc: BaseException | None = None) -> None:
    """Resolve `future` unless a caller cancelled it meanwhile (then the result is dropped)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass


def video_id(data: bytes) -> str:
    """Content hash naming a video across instances (and its embeddings in the MM cache)."""
    return hashlib.sha256(data).hexdigest()
