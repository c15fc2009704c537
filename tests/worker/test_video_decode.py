"""Collaborative decoding: frames pixel-identical to a plain sequential PyAV decode, the
seek rule per codec, stall-free scheduling, and a typed error for each kind of bad video."""

from __future__ import annotations

import io
import os
import threading
import time
from functools import cache

import numpy as np
import pytest

from triptych.worker.video.synthetic import audio_only_clip
from worker.video import decode as decode_module
from worker.video.collaborative import CollaborativeDecoder, LocalSlot
from worker.video.decode import DecodedSegment, DecoderUnavailableError, NvdecBackend, PyAVBackend
from worker.video.demux import index_video
from worker.video.errors import (
    EmptyVideoError,
    InvalidVideoError,
    UnsupportedCodecError,
    VideoError,
    VideoTooLargeError,
    VideoTooLongError,
)
from worker.video.limits import VideoLimits
from worker.video.sampling import SamplingOptions, sample_frame_indices
from worker.video.segments import plan_segments
from worker.video.synthetic import make_clip, sequential_decode

FRAMES = 61  # odd on purpose
CLIPS = {
    "h264-fixed-gop": dict(codec="libx264", gop=8, b_frames=2),
    "h264-open-gop-bframes": dict(codec="libx264", gop=8, b_frames=2, open_gop=True),
    "h264-single-gop": dict(codec="libx264", gop=0, b_frames=2),
    "mpeg4-fixed-gop-bframes": dict(codec="mpeg4", gop=8, b_frames=2),
    "mpeg4-single-gop": dict(codec="mpeg4", gop=0, b_frames=2),
    "vp9-fixed-gop": dict(codec="libvpx-vp9", gop=8, b_frames=0),
}


@cache
def clip(name: str) -> bytes:
    return make_clip(FRAMES, **CLIPS[name])


@cache
def reference(name: str) -> np.ndarray:
    return sequential_decode(clip(name))


@pytest.fixture(scope="module")
def pool():
    with CollaborativeDecoder(num_decoders=3) as decoder:
        yield decoder


@pytest.mark.parametrize("name", list(CLIPS))
def test_collaborative_frames_equal_sequential_decode(name: str, pool: CollaborativeDecoder) -> None:
    data, ref = clip(name), reference(name)
    index = index_video(data)
    assert index.total_num_frames == len(ref) == FRAMES
    if CLIPS[name]["gop"]:
        assert len(index.gops) > 4
    else:
        assert len(index.gops) == 1
    for fps in (2.0, 6.0, 24.0):
        options = SamplingOptions(fps=fps, min_frames=1)
        out = pool.decode(data, temporal_patch_size=2, options=options, timeout=60)
        assert out.frame_indices == sample_frame_indices(FRAMES, index.fps, 2, options)
        assert np.array_equal(out.frames(), ref[out.frame_indices]), (name, fps)
        assert all(len(s.frame_indices) % 2 == 0 for s in out.segments[:-1])


@pytest.mark.parametrize("name", ["h264-open-gop-bframes", "mpeg4-fixed-gop-bframes"])
def test_every_frame_through_many_segments(name: str) -> None:
    data, ref = clip(name), reference(name)
    index = index_video(data)
    for frames in (list(range(FRAMES)), list(range(1, FRAMES, 3)), [7, 8, 9, 60]):
        for parts, tps in ((1, 2), (5, 2), (16, 4), (16, 1)):
            segments = plan_segments(index, frames, tps, parts, video_id="x")
            decoded = [PyAVBackend().decode(data, s) for s in segments]
            got = np.concatenate([d.frames for d in decoded])
            assert np.array_equal(got, ref[frames]), (name, frames[:3], parts, tps)


class _CountingContainer:
    def __init__(self, inner) -> None:
        self._inner, self.seeks = inner, 0

    def seek(self, *args, **kwargs):
        self.seeks += 1
        return self._inner.seek(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize(("name", "per_gop"), [("h264-fixed-gop", False), ("mpeg4-fixed-gop-bframes", True)])
def test_h264_seeks_once_per_segment_other_codecs_per_gop(name: str, per_gop: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[_CountingContainer] = []
    real_open = decode_module.open_container

    def counting_open(data: bytes):
        opened.append(_CountingContainer(real_open(data)))
        return opened[-1]

    monkeypatch.setattr(decode_module, "open_container", counting_open)
    data = clip(name)
    index = index_video(data)
    (segment,) = plan_segments(index, list(range(0, FRAMES, 5)), 2, 1)
    assert len(segment.gops) > 3
    out = PyAVBackend().decode(data, segment)
    assert np.array_equal(out.frames, reference(name)[segment.frame_indices])
    assert opened[0].seeks == (len(segment.gops) if per_gop else 1)


# --- scheduling -----------------------------------------------------------------------


class _RecordingSlot:
    """Decodes for real, records (slot, video, segment) in the order work was taken."""

    def __init__(self, name: str, log: list, gate: threading.Event | None = None) -> None:
        self.name, self.log, self.gate, self.inner = name, log, gate, LocalSlot()

    def run(self, data: bytes, segment) -> DecodedSegment:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.log.append((self.name, segment.video_id, segment.index))
        return self.inner.run(data, segment)


def test_a_free_decoder_takes_its_own_requests_next_set_first() -> None:
    log: list = []
    gate = threading.Event()
    decoder = CollaborativeDecoder(slots=[_RecordingSlot("d0", log, gate)])
    try:
        futures = []
        for name in ("h264-fixed-gop", "mpeg4-fixed-gop-bframes"):
            data = clip(name)
            index = index_video(data)
            segments = plan_segments(index, list(range(0, FRAMES, 2)), 2, 3, video_id=name)
            futures.append(decoder.submit(data, index, segments))
        gate.set()
        for future in futures:
            future.result(timeout=60)
    finally:
        decoder.close()
    # One decoder, two queued videos: all of the first video's sets, then the second's.
    assert [v for _, v, _ in log] == ["h264-fixed-gop"] * 3 + ["mpeg4-fixed-gop-bframes"] * 3


class _SlowSlot(LocalSlot):
    def run(self, data: bytes, segment) -> DecodedSegment:
        time.sleep(0.4)
        return super().run(data, segment)


def test_stall_free_a_fast_decoder_takes_more_sets_than_a_slow_one() -> None:
    log: list = []
    slow, fast = _RecordingSlot("slow", log), _RecordingSlot("fast", log)
    slow.inner = _SlowSlot()
    with CollaborativeDecoder(slots=[slow, fast]) as decoder:
        data = clip("h264-fixed-gop")
        index = index_video(data)
        segments = plan_segments(index, list(range(FRAMES)), 2, 6, video_id="v")
        assert len(segments) == 6
        out = decoder.submit(data, index, segments).result(timeout=60)
    assert np.array_equal(out.frames(), reference("h264-fixed-gop"))
    # No fixed share per decoder (§3.3): the slow one is still on its first set while the
    # fast one drains the rest.
    assert [name for name, _, _ in log].count("fast") >= 4


def test_a_failing_video_fails_alone_and_the_pool_keeps_serving(pool: CollaborativeDecoder) -> None:
    data = clip("h264-fixed-gop")
    index = index_video(data)
    segments = plan_segments(index, list(range(FRAMES)), 2, 4, video_id="bad")
    broken = [s.model_copy(update={"gops": [s.gops[0].model_copy(update={"frame_pts": [10**9]})]})
              for s in segments]
    with pytest.raises(VideoError):
        pool.submit(data, index, broken).result(timeout=30)
    out = pool.decode(data, 2, timeout=30)
    assert np.array_equal(out.frames(), reference("h264-fixed-gop")[out.frame_indices])


def test_timeout_cancels_the_queued_sets() -> None:
    gate = threading.Event()
    decoder = CollaborativeDecoder(slots=[_RecordingSlot("d0", [], gate)])
    try:
        with pytest.raises(TimeoutError):
            decoder.decode(clip("h264-fixed-gop"), 2, timeout=0.2)
        assert not decoder._jobs
    finally:
        gate.set()
        decoder.close()


# --- bad videos -----------------------------------------------------------------------




def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("case", "error"), [
    ("truncated", InvalidVideoError),
    ("not-a-video", InvalidVideoError),
    ("empty-bytes", InvalidVideoError),
    ("unsupported-codec", UnsupportedCodecError),
    ("too-long-seconds", VideoTooLongError),
    ("too-long-frames", VideoTooLongError),
    ("too-large-pixels", VideoTooLargeError),
    ("too-large-bytes", VideoTooLargeError),
    ("zero-frames", EmptyVideoError),
])
def test_bad_videos_raise_typed_errors(case: str, error: type[VideoError], pool: CollaborativeDecoder) -> None:
    good = clip("h264-fixed-gop")
    data, limits = {
        "truncated": (good[: len(good) // 2], None),
        "not-a-video": (b"this is not a video " * 50, None),
        "empty-bytes": (b"", None),
        "unsupported-codec": (_png(), None),
        "too-long-seconds": (good, VideoLimits(max_duration_s=1.0)),
        "too-long-frames": (good, VideoLimits(max_frames=60)),
        "too-large-pixels": (good, VideoLimits(max_pixels=64 * 47)),
        "too-large-bytes": (good, VideoLimits(max_bytes=len(good) - 1)),
        "zero-frames": (audio_only_clip(), None),
    }[case]
    with pytest.raises(error) as info:
        pool.decode(data, 2, limits=limits, timeout=30)
    assert isinstance(info.value, ValueError) and str(info.value)  # a 400 with a message
    assert pool.decode(good, 2, timeout=30).frame_indices  # and the pool still serves


def test_index_lists_keyframes_as_gops() -> None:
    index = index_video(clip("h264-fixed-gop"))
    assert [g.first_frame for g in index.gops] == list(range(0, FRAMES, 8))
    assert index.codec == "h264" and (index.width, index.height) == (64, 48) and index.fps == 24.0
    assert all(g.byte_offset > 0 for g in index.gops)


def test_nvdec_backend_is_guarded_without_a_gpu() -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        pytest.skip("a GPU is present: see the gpu-marked test")
    with pytest.raises(DecoderUnavailableError):
        NvdecBackend()
    assert isinstance(decode_module.make_backend("auto"), PyAVBackend)


@pytest.mark.gpu
def test_nvdec_frames_match_the_sampled_indices() -> None:
    try:
        backend = NvdecBackend()
    except DecoderUnavailableError as exc:
        pytest.skip(str(exc))
    data = clip("h264-fixed-gop")
    index = index_video(data)
    segments = plan_segments(index, list(range(0, FRAMES, 4)), 2, 3, video_id="nv")
    start = time.monotonic()
    out = [backend.decode(data, s) for s in segments]
    assert time.monotonic() - start < 60
    frames = np.concatenate([o.frames.cpu().numpy() for o in out])
    ref = reference("h264-fixed-gop")[[f for s in segments for f in s.frame_indices]]
    # NV12 from NVDEC, converted with swscale's arithmetic (yuv.py): PyAV's pixels exactly.
    assert frames.shape == ref.shape and np.array_equal(frames, ref), np.abs(frames.astype(int) - ref).mean()


def test_nvdec_backend_keeps_one_file_per_video_and_releases_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVDEC backend's bookkeeping, on the CPU (PyNvVideoCodec stubbed out): one
    temporary file and colour per video however often its segments come, and `release`
    drops that file and every thread's decoder of it, once."""
    monkeypatch.setattr(decode_module, "_import_nvc", lambda: None)
    backend = NvdecBackend()
    data = clip("h264-fixed-gop")
    path, colour = backend._file(data, "v1")
    assert open(path, "rb").read() == data and colour == (2, 0)  # untagged: unspecified matrix, range
    assert backend._file(b"other bytes", "v1") == (path, colour)  # written once
    other, _ = backend._file(data, "v2")
    assert other != path
    backend._decoders.update({(1, path): object(), (2, path): object(), (1, other): object()})
    backend.release("v1")
    backend.release("v1")  # already gone: nothing to do
    backend.release("never seen")
    assert not os.path.exists(path) and list(backend._decoders) == [(1, other)]
    backend.close()
    assert not os.path.exists(other) and backend._files == {}
