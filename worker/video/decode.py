"""Decoding backends: one segment (GOP set) of a video -> its frames as RGB.

`PyAVBackend` (CPU, FFmpeg through PyAV) follows FlashCodec's Alg. 1 (paper 000 §3.2):
seek to the segment's first keyframe, decode forward, keep the frames whose pts are wanted,
stop at the last one; H.264 seeks once and decodes straight through the segment's GOPs,
other codecs seek to each GOP. Decoded frames stay in the decoder's YUV buffers until the
segment is done; only then is the RGB output allocated and filled (§3.4: frame memory
after decoding, not reserved when the work is accepted).

`NvdecBackend` (NVDEC through PyNvVideoCodec) is the GPU path. PyNvVideoCodec raises
RuntimeError at import on a machine without a GPU, so it is imported lazily and both
(ImportError, RuntimeError) mean "not available here". It takes NVDEC's NV12 and converts
on the GPU with swscale's arithmetic (yuv.py), so its pixels equal PyAV's.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .demux import open_container
from .errors import CorruptVideoError
from .segments import GopTask, Segment


@dataclass
class DecodedSegment:
    """The frames of one segment, in the segment's frame order."""

    segment: int
    frame_indices: list[int]
    frames: Any  # np.ndarray [n, H, W, 3] uint8 (PyAV) or a CUDA torch tensor of that shape (NVDEC)


class DecoderBackend(Protocol):
    name: str

    def decode(self, data: bytes, segment: Segment) -> DecodedSegment: ...


class DecoderUnavailableError(RuntimeError):
    """The requested decoder cannot run on this machine (no GPU, library missing)."""


class PyAVBackend:
    """CPU decoding with FFmpeg. `threads` is FFmpeg's own per-decoder threading; the
    collaborative decoder runs one single-threaded decoder per core instead (GOP
    parallelism scales where frame threading stalls on references)."""

    name = "pyav"

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads

    def decode(self, data: bytes, segment: Segment) -> DecodedSegment:
        import av

        container = open_container(data)
        try:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = self.threads
            runs = [[task] for task in segment.gops] if segment.seek_per_gop else [segment.gops]
            kept: dict[int, Any] = {}
            for run in runs:
                kept.update(_decode_run(container, stream, run))
        except av.FFmpegError as exc:
            raise CorruptVideoError(f"video does not decode: {exc}") from None
        finally:
            container.close()
        pts = segment.frame_pts
        frames = _to_rgb([kept[p] for p in pts])  # §3.4: allocated now that decoding is done
        return DecodedSegment(segment.index, segment.frame_indices, frames)


def _decode_run(container: Any, stream: Any, run: list[GopTask]) -> dict[int, Any]:
    """Seek once to the run's first keyframe and decode forward until every wanted pts came out."""
    wanted = {p for task in run for p in task.frame_pts}
    last = max(wanted)
    kept: dict[int, Any] = {}
    # backward=True lands on the keyframe at or before the pts; PyAV flushes the decoder on seek.
    container.seek(run[0].keyframe_pts, stream=stream, backward=True, any_frame=False)
    for packet in container.demux(stream):  # ends with an empty packet that flushes the decoder
        for frame in stream.decode(packet):
            if frame.pts in wanted:
                kept[frame.pts] = frame
                wanted.discard(frame.pts)
            if not wanted:
                return kept
            if frame.pts is not None and frame.pts >= last:
                raise CorruptVideoError(f"{len(wanted)} frame(s) of GOP {run[0].gop} never decoded")
    raise CorruptVideoError(f"video ended before {len(wanted)} wanted frame(s) (truncated?)")


def _to_rgb(frames: list[Any]) -> np.ndarray:
    first = frames[0]
    out = np.empty((len(frames), first.height, first.width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        if (frame.height, frame.width) != out.shape[1:3]:
            raise CorruptVideoError("video frames change size mid-stream")
        out[i] = frame.to_ndarray(format="rgb24")
    return out


# --- NVDEC ----------------------------------------------------------------------------


def _import_nvc() -> Any:
    try:
        import PyNvVideoCodec as nvc
    except (ImportError, RuntimeError) as exc:  # RuntimeError: no GPU/driver at import
        raise DecoderUnavailableError(f"NVDEC decoding needs PyNvVideoCodec and a GPU: {exc}") from None
    return nvc


class NvdecBackend:
    """GPU decoding on NVDEC. Frames come back as RGB CUDA tensors [n, H, W, 3] uint8.

    PyNvVideoCodec's SimpleDecoder reads from a file and seeks by frame index (to the
    keyframe before it, then decodes forward: Alg. 1 lines 6-18 inside the library), so
    the video's bytes are written once to a private temporary file per video id. One
    SimpleDecoder per (thread, video): NVDEC sessions are not shared between threads.
    It outputs NV12 (decoding is bit-exact), converted to RGB by `yuv.nv12_to_rgb` with
    the stream's colour matrix and range, as PyAV converts: NVDEC's own RGB differs.
    """

    name = "nvdec"

    def __init__(self, gpu_id: int = 0) -> None:
        self._nvc = _import_nvc()
        self.gpu_id = gpu_id
        # video id -> its temporary file and (colorspace, color_range), read once with it
        self._files: dict[str, tuple[str, tuple[int, int]]] = {}
        # (thread, file) -> SimpleDecoder; one table (not thread-locals) so that `release`
        # closes every thread's decoder of a video, not only the calling thread's.
        self._decoders: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def _file(self, data: bytes, video_id: str) -> tuple[str, tuple[int, int]]:
        with self._lock:
            entry = self._files.get(video_id)
            if entry is None:
                fd, path = tempfile.mkstemp(prefix="triptych-video-", suffix=".bin")
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                entry = self._files[video_id] = (path, _colour(data))
            return entry

    def _decoder(self, path: str) -> Any:
        key = (threading.get_ident(), path)
        with self._lock:
            decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self._nvc.SimpleDecoder(
                path, gpu_id=self.gpu_id, use_device_memory=True,
                output_color_type=self._nvc.OutputColorType.NATIVE)
            with self._lock:
                self._decoders[key] = decoder
        return decoder

    def decode(self, data: bytes, segment: Segment) -> DecodedSegment:
        import torch

        from .yuv import nv12_to_rgb  # torch: never imported where the router reads this module

        path, colour = self._file(data, segment.video_id)
        decoder = self._decoder(path)
        try:
            raw = decoder.get_batch_frames_by_index(segment.frame_indices)
        except (RuntimeError, ValueError) as exc:
            raise CorruptVideoError(f"NVDEC could not decode the video: {exc}") from None
        if len(raw) != len(segment.frame_indices):
            raise CorruptVideoError(f"NVDEC returned {len(raw)} of {len(segment.frame_indices)} frames")
        # §3.4: the output tensor is allocated after the segment is decoded.
        frames = nv12_to_rgb(torch.stack([_nv12(torch.from_dlpack(f)) for f in raw]), *colour)
        return DecodedSegment(segment.index, segment.frame_indices, frames)

    def release(self, video_id: str) -> None:
        """Forget a finished video: its temporary file goes (decoders reopen if it comes back)."""
        with self._lock:
            entry = self._files.pop(video_id, None)
            if entry is None:
                return
            path = entry[0]
            for key in [k for k in self._decoders if k[1] == path]:
                del self._decoders[key]  # a decode running on it keeps its own reference
        os.unlink(path)

    def close(self) -> None:
        """Every video's temporary file and decoder go (the instance shuts down)."""
        with self._lock:
            held = list(self._files)
        for vid in held:
            self.release(vid)


def _nv12(frame: Any) -> Any:
    """An NV12 frame as [H * 3/2, W] (DLPack may add a trailing channel axis of 1)."""
    return frame[..., 0] if frame.dim() == 3 and frame.shape[-1] == 1 else frame


def _colour(data: bytes) -> tuple[int, int]:
    """The video stream's colour matrix and range (AVColorSpace, AVColorRange), as PyAV
    reads them from the container (what its RGB conversion uses)."""
    container = open_container(data)
    try:
        context = container.streams.video[0].codec_context
        return int(context.colorspace), int(context.color_range)
    finally:
        container.close()


def make_backend(kind: str = "auto", gpu_id: int = 0) -> DecoderBackend:
    """'pyav', 'nvdec', or 'auto' (NVDEC where it is available, else PyAV)."""
    return choose_backend(kind, gpu_id)[0]


def choose_backend(kind: str = "auto", gpu_id: int = 0) -> tuple[DecoderBackend, str]:
    """The backend for `kind` and why it was chosen (a V instance reports it in
    /admin/stats). 'auto' takes NVDEC when a CUDA device and PyNvVideoCodec are both
    there, else PyAV; a forced 'nvdec' that cannot run raises DecoderUnavailableError."""
    if kind == "pyav":
        return PyAVBackend(), "pyav: forced (--video-decoder pyav)"
    if kind == "nvdec":
        return NvdecBackend(gpu_id), f"nvdec: forced (--video-decoder nvdec), GPU {gpu_id}"
    if kind != "auto":
        raise ValueError(f"unknown video decoder {kind!r} (pyav, nvdec, auto)")
    if not _cuda_available():
        return PyAVBackend(), "pyav: auto, no CUDA device here"
    try:
        return NvdecBackend(gpu_id), f"nvdec: auto, CUDA and PyNvVideoCodec available, GPU {gpu_id}"
    except DecoderUnavailableError as exc:
        return PyAVBackend(), f"pyav: auto, NVDEC unavailable ({exc})"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
