"""Demux once, index frames and GOPs from the container (FlashCodec, paper 000 §3.1/§3.2).

`index_video` reads every packet of the video stream without decoding any of them: the
packets' presentation timestamps give the frames in display order (frame index i is the
i-th smallest pts) and the packets flagged as keyframes give the GOPs — a GOP runs from
one keyframe's frame to the frame before the next keyframe's, in display order. That
index is all segment planning needs (`segments.py`), and it is cheap (no pixels).

Limits are checked as early as the container allows: bytes first, then the stream's
declared size and duration, then the counted frames and the measured duration.
"""

from __future__ import annotations

import bisect
import io
from dataclasses import dataclass
from fractions import Fraction

from .errors import (
    CorruptVideoError,
    EmptyVideoError,
    InvalidVideoError,
    UnsupportedCodecError,
    VideoTooLargeError,
    VideoTooLongError,
)
from .limits import VideoLimits

# FFmpeg decoder names we accept. Still-image codecs (png, gif, ...) that FFmpeg also
# opens as one-frame "videos" are refused: images go through the image path.
SUPPORTED_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mpeg1video"})
H264 = "h264"


@dataclass(frozen=True)
class Gop:
    """One group of pictures: frames [first_frame, first_frame + num_frames) in display order."""

    index: int
    first_frame: int
    num_frames: int
    keyframe_pts: int  # where a seek lands (stream time base)
    byte_offset: int  # the keyframe packet's position in the file (-1 if the container does not say)


@dataclass(frozen=True)
class VideoIndex:
    """What the container says about one video stream, frame by frame."""

    codec: str
    width: int
    height: int
    fps: float  # average frame rate (transformers' `VideoMetadata.fps`)
    time_base: Fraction
    frame_pts: tuple[int, ...]  # display order
    gops: tuple[Gop, ...]
    num_bytes: int

    @property
    def total_num_frames(self) -> int:
        return len(self.frame_pts)

    @property
    def duration_s(self) -> float:
        return self.total_num_frames / self.fps

    def gop_of(self, frame: int) -> Gop:
        """The GOP whose display range holds `frame`."""
        if not 0 <= frame < self.total_num_frames:
            raise IndexError(f"frame {frame} is outside 0..{self.total_num_frames - 1}")
        starts = [g.first_frame for g in self.gops]
        return self.gops[bisect.bisect_right(starts, frame) - 1]


def open_container(data: bytes):  # -> av.container.InputContainer (PyAV is imported lazily)
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"not a readable video container: {exc}") from None


def index_video(data: bytes, limits: VideoLimits | None = None) -> VideoIndex:
    """Demux `data` once and index its first video stream (see the module docstring)."""
    import av

    limits = limits or VideoLimits()
    if not data:
        raise InvalidVideoError("empty video data")
    if len(data) > limits.max_bytes:
        raise VideoTooLargeError(f"video is {len(data)} bytes; the limit is {limits.max_bytes}")
    container = open_container(data)
    try:
        if not container.streams.video:
            raise InvalidVideoError("the container holds no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in SUPPORTED_CODECS:
            raise UnsupportedCodecError(
                f"video codec {codec!r} is not supported ({', '.join(sorted(SUPPORTED_CODECS))})")
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_size(width, height, limits)
        time_base = stream.time_base or Fraction(1, 1)
        if stream.duration is not None and float(stream.duration * time_base) > limits.max_duration_s:
            raise VideoTooLongError(
                f"video lasts {float(stream.duration * time_base):.1f} s; the limit is {limits.max_duration_s} s")
        packets = _read_packets(container, stream, limits)
        rate = stream.average_rate or stream.guessed_rate
    except av.FFmpegError as exc:
        raise CorruptVideoError(f"cannot demux the video: {exc}") from None
    finally:
        container.close()
    if not packets:
        raise EmptyVideoError("the video stream holds no frames")
    fps = float(rate) if rate else _fps_from_pts(packets, time_base)
    return _build_index(codec, width, height, fps, time_base, packets, len(data), limits)


def _check_size(width: int, height: int, limits: VideoLimits) -> None:
    if width <= 0 or height <= 0:
        raise InvalidVideoError(f"video frames have no size ({width}x{height})")
    if width > limits.max_width or height > limits.max_height or width * height > limits.max_pixels:
        raise VideoTooLargeError(
            f"video frames are {width}x{height}; the limits are {limits.max_width}x{limits.max_height} "
            f"and {limits.max_pixels} pixels")


def _read_packets(container, stream, limits: VideoLimits) -> list[tuple[int, bool, int]]:
    """(pts, is_keyframe, byte position) of each non-empty packet, in decode order."""
    out: list[tuple[int, bool, int]] = []
    for packet in container.demux(stream):
        if not packet.size:  # the demuxer's end-of-stream marker
            continue
        pts = packet.pts if packet.pts is not None else packet.dts
        if pts is None:
            raise InvalidVideoError("video packets carry no timestamps")
        out.append((int(pts), bool(packet.is_keyframe), int(packet.pos) if packet.pos is not None else -1))
        if len(out) > limits.max_frames:
            raise VideoTooLongError(f"video has more than {limits.max_frames} frames")
    return out


def _fps_from_pts(packets: list[tuple[int, bool, int]], time_base: Fraction) -> float:
    pts = sorted(p for p, _, _ in packets)
    span = float((pts[-1] - pts[0]) * time_base)
    return (len(pts) - 1) / span if span > 0 else 1.0


def _build_index(codec: str, width: int, height: int, fps: float, time_base: Fraction,
                 packets: list[tuple[int, bool, int]], num_bytes: int, limits: VideoLimits) -> VideoIndex:
    frame_pts = sorted(p for p, _, _ in packets)
    if len(set(frame_pts)) != len(frame_pts):
        raise CorruptVideoError("video packets repeat presentation timestamps")
    duration = len(frame_pts) / fps
    if duration > limits.max_duration_s:
        raise VideoTooLongError(f"video lasts {duration:.1f} s; the limit is {limits.max_duration_s} s")
    position = {pts: i for i, pts in enumerate(frame_pts)}
    keys = sorted((position[p], p, pos) for p, key, pos in packets if key)
    if not keys:
        raise CorruptVideoError("the video stream has no keyframe")
    # Frames shown before the first keyframe (rare: a stream cut mid-GOP) join the first GOP;
    # its seek goes to the stream's start.
    starts = [0] + [frame for frame, _, _ in keys[1:]]
    seek_pts = [min(frame_pts[0], keys[0][1])] + [p for _, p, _ in keys[1:]]
    offsets = [pos for _, _, pos in keys]
    ends = starts[1:] + [len(frame_pts)]
    gops = tuple(Gop(i, s, e - s, seek_pts[i], offsets[i]) for i, (s, e) in enumerate(zip(starts, ends, strict=True)))
    return VideoIndex(codec, width, height, fps, time_base, tuple(frame_pts), gops, num_bytes)
