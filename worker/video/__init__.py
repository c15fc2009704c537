"""Video decoding for the V instance type (FlashCodec ideas, paper 000 §3).

Torch-free at import (the router may demux to count tokens): PyAV is imported when a video
is opened, PyNvVideoCodec and torch only by the NVDEC backend.

    index_video(bytes, limits)            demux once: frames, GOPs, fps, size     (demux.py)
    sample_frame_indices(total, fps, T)   transformers' Qwen2-VL sampling          (sampling.py)
    plan_segments(index, frames, T, n)    GOP-aligned, T-aligned GOP sets          (segments.py)
    PyAVBackend / NvdecBackend            one segment -> RGB frames                (decode.py)
    CollaborativeDecoder                  stall-free pool of decoder slots          (collaborative.py)
"""

from .collaborative import CollaborativeDecoder, DecodedVideo, DecoderSlot, LocalSlot, video_id
from .decode import (
    DecodedSegment,
    DecoderBackend,
    DecoderUnavailableError,
    NvdecBackend,
    PyAVBackend,
    choose_backend,
    make_backend,
)
from .demux import SUPPORTED_CODECS, Gop, VideoIndex, index_video
from .errors import (
    CorruptVideoError,
    EmptyVideoError,
    InvalidVideoError,
    UnsupportedCodecError,
    VideoError,
    VideoTooLargeError,
    VideoTooLongError,
)
from .limits import VideoLimits
from .sampling import SamplingOptions, sample_frame_indices, second_per_grid_t
from .segments import GopTask, Segment, plan_segments

__all__ = [
    "SUPPORTED_CODECS", "CollaborativeDecoder", "CorruptVideoError", "DecodedSegment", "DecodedVideo",
    "DecoderBackend", "DecoderSlot", "DecoderUnavailableError", "EmptyVideoError", "Gop", "GopTask",
    "InvalidVideoError", "LocalSlot", "NvdecBackend", "PyAVBackend", "SamplingOptions", "Segment",
    "UnsupportedCodecError", "VideoError", "VideoIndex", "VideoLimits", "VideoTooLargeError",
    "VideoTooLongError", "choose_backend", "index_video", "make_backend", "plan_segments", "sample_frame_indices",
    "second_per_grid_t", "video_id",
]
