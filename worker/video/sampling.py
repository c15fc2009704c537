"""Which frames of a video the model sees: transformers' Qwen2-VL frame sampling.

A faithful, torch-free transcription of `Qwen2VLVideoProcessor.sample_frames`
(transformers 5.23.0, models/qwen2_vl/video_processing_qwen2_vl.py, the body of
`sample_frames`): with `fps`, the frame count is the video's duration times `fps`,
bounded below by `min_frames` and above by `max_frames` and the frame total, floored to a
multiple of the temporal patch size; the indices are `torch.arange(0, total, total / n)
.int()` — a float32 arange (each value computed in double, rounded to float32, truncated), less the one index past
the end that arange's rounding sometimes adds (see `sample_frame_indices`).
tests/worker/test_video_sampling.py runs transformers' own function body on the same
inputs and compares.

Defaults follow vLLM's `mm_processor_kwargs` for Qwen video and Qwen's own tooling
(qwen-vl-utils): 2 frames per second, at least 4 and at most 768 frames.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import EmptyVideoError, VideoError

DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 768


class SamplingOptions(BaseModel):
    """Per-request frame sampling (the video part of vLLM-style `mm_processor_kwargs`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fps: float | None = Field(None, gt=0, le=240)  # None: DEFAULT_FPS unless num_frames is set
    num_frames: int | None = Field(None, ge=1)  # exclusive with fps (transformers' rule)
    min_frames: int = Field(DEFAULT_MIN_FRAMES, ge=1)
    max_frames: int = Field(DEFAULT_MAX_FRAMES, ge=1)

    @model_validator(mode="after")
    def _one_rule(self) -> SamplingOptions:
        if self.num_frames is not None and self.fps is not None:
            raise ValueError("`num_frames` and `fps` are mutually exclusive; set the other to null")
        if self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) exceeds max_frames ({self.max_frames})")
        return self

    @classmethod
    def from_request(cls, kwargs: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> SamplingOptions:
        """vLLM-style per-request `mm_processor_kwargs` (its sampling keys) over the checkpoint's
        defaults (`VideoProcessorConfig.sampling_defaults()`); a request's `num_frames`
        replaces a default `fps`. Bad values raise pydantic's ValidationError (a 400)."""
        merged = {**(defaults or {}), **(kwargs or {})}
        if (kwargs or {}).get("num_frames") is not None and "fps" not in (kwargs or {}):
            merged.pop("fps", None)
        return cls.model_validate(merged)

    @property
    def effective_fps(self) -> float | None:
        return self.fps if self.fps is not None or self.num_frames is not None else DEFAULT_FPS


def sample_frame_indices(total_num_frames: int, video_fps: float, temporal_patch_size: int,
                         options: SamplingOptions | None = None) -> list[int]:
    """Frame indices (display order, ascending) to decode for the model.

    Where transformers would fail — a video with fewer frames than one temporal patch, whose
    floored count is 0 (transformers divides by zero) — every frame is taken instead, and
    patchify repeats the last one, as for any count that is not a multiple.
    """
    options = options or SamplingOptions()
    if total_num_frames < 1:
        raise EmptyVideoError("a video without frames has nothing to sample")
    tps = temporal_patch_size
    if options.num_frames is not None:
        num_frames = round(options.num_frames / tps) * tps
    else:
        fps = options.effective_fps or DEFAULT_FPS
        max_frames = math.floor(min(options.max_frames, total_num_frames) / tps) * tps
        wanted = total_num_frames / video_fps * fps
        wanted = min(max(wanted, options.min_frames), max_frames, total_num_frames)
        num_frames = math.floor(wanted / tps) * tps
    if num_frames > total_num_frames:
        raise VideoError(f"cannot sample {num_frames} frames from a video of {total_num_frames} frames")
    if num_frames == 0:
        return list(range(total_num_frames))
    # transformers' arange sometimes yields one element more than `num_frames` (its length is
    # ceil(total / (total / n)), which double rounding can push to n + 1), and that extra
    # index equals `total_num_frames`: past the last frame, so no decoder returns it. We keep
    # the `num_frames` indices a decoder can return.
    return _float32_arange_int(total_num_frames, total_num_frames / num_frames)[:num_frames]


def _float32_arange_int(end: int, step: float) -> list[int]:
    """`torch.arange(0, end, step).int()` on CPU: length ceil(end / step) computed in double;
    element i = float32(i * step) (accumulated in double), truncated toward zero."""
    count = math.ceil(end / step)
    return [int(_to_float32(i * step)) for i in range(count)]


def _to_float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def second_per_grid_t(num_sampled: int, total_num_frames: int, video_fps: float, temporal_patch_size: int) -> float:
    """Qwen2.5-VL's seconds per temporal grid step: temporal_patch_size / sampled fps, the
    sampled fps being `VideoMetadata.sampled_fps` (sampled / total * the video's fps)."""
    return temporal_patch_size / (num_sampled / total_num_frames * video_fps)
