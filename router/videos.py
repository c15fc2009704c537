"""Video content parts -> their placeholder runs, without decoding a pixel (docs/video.md).

The router demuxes each video once (`index_video`: frame count, size, timing, checked
against the server's limits), samples the frames the model will see with the request's
`mm_processor_kwargs` over the checkpoint's defaults (vLLM's names; 2 fps by default) and
counts the tokens from the grid. The encode instance decodes the same frames with the same
options (carried in the stage request as `VideoOptions`), so its embedding fills the run.
Every bad video or option is an `InvalidRequestError` (400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from triptych.error_text import short_error
from triptych.processor import PromptError
from triptych.router.config import RouterConfig
from triptych.router.errors import InvalidRequestError
from triptych.stage_protocol import VideoOptions, video_content_key
from triptych.video_processing import FRAMES_AS_IMAGES_MODEL_TYPES, VideoProcessorConfig, VideoTokens
from triptych.worker.video import (
    EmptyVideoError,
    SamplingOptions,
    UnsupportedCodecError,
    VideoError,
    VideoLimits,
    VideoTooLargeError,
    VideoTooLongError,
    index_video,
    sample_frame_indices,
    second_per_grid_t,
)

SAMPLING_KEYS = ("fps", "num_frames", "min_frames", "max_frames")
PIXEL_KEYS = ("min_pixels", "max_pixels")
MM_PROCESSOR_KWARGS = SAMPLING_KEYS + PIXEL_KEYS
_PARAM = "mm_processor_kwargs"


@dataclass(frozen=True)
class VideoModel:
    """What a checkpoint needs to count a video's tokens."""

    config: VideoProcessorConfig
    video_token_id: int | None  # None: the frames are taken as images (LLaVA)
    uses_seconds_per_grid: bool  # Qwen2.5-VL: M-RoPE temporal spacing from tokens_per_second

    @property
    def frames_as_images(self) -> bool:
        return self.config.frames_as_images


@cache
def video_model(model_dir: str) -> VideoModel | None:
    """None when the checkpoint takes no video. LLaVA has no video token: it takes each
    sampled frame as one image (`VideoProcessorConfig.for_frames_as_images`)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if cfg.get("model_type") in FRAMES_AS_IMAGES_MODEL_TYPES:
        return VideoModel(VideoProcessorConfig.for_frames_as_images(), None, False)
    token = cfg.get("video_token_id")
    if not isinstance(token, int):
        return None
    vision = cfg.get("vision_config") or {}
    return VideoModel(VideoProcessorConfig.from_pretrained(model_dir), token,
                      "tokens_per_second" in vision or "tokens_per_second" in cfg)


def check_keys(kwargs: dict[str, Any] | None, has_images: bool) -> None:
    """400 for an `mm_processor_kwargs` key that is not a video option, and for pixel
    bounds in a request with images: per request they size videos only (images keep the
    checkpoint's bounds), so they would change an image's tokens silently otherwise."""
    unknown = sorted(set(kwargs or {}) - set(MM_PROCESSOR_KWARGS))
    if unknown:
        raise InvalidRequestError(f"unsupported mm_processor_kwargs key(s): {', '.join(unknown)} (accepted: "
                                  f"{', '.join(MM_PROCESSOR_KWARGS)})", param=_PARAM)
    if has_images and (bounds := sorted(set(kwargs or {}) & set(PIXEL_KEYS))):
        raise InvalidRequestError(f"mm_processor_kwargs {', '.join(bounds)}: per-request pixel bounds size videos "
                                  "only; images are sized by the checkpoint's image processor", param=_PARAM)


def resolve_options(kwargs: dict[str, Any] | None, model: VideoModel, config: RouterConfig
                    ) -> tuple[VideoProcessorConfig, SamplingOptions, dict[str, Any]]:
    """The request's `mm_processor_kwargs` over the checkpoint's defaults -> the processor
    config (pixel bounds), the sampling options, and the resolved options to send the encoder."""
    kwargs = dict(kwargs or {})
    check_keys(kwargs, has_images=False)
    if model.frames_as_images and (bounds := sorted(set(kwargs) & set(PIXEL_KEYS))):
        raise InvalidRequestError(f"mm_processor_kwargs {', '.join(bounds)}: this model takes a video's frames as "
                                  "images, each sized by its image processor (a fixed size)", param=_PARAM)
    try:
        cfg = model.config.with_pixel_bounds(kwargs.get("min_pixels"), kwargs.get("max_pixels"))
        options = SamplingOptions.from_request({k: v for k, v in kwargs.items() if k in SAMPLING_KEYS},
                                               model.config.sampling_defaults())
    except (PromptError, ValidationError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid mm_processor_kwargs: {short_error(exc)}", param=_PARAM) from None
    cap = config.max_video_sampled_frames
    if (options.num_frames or 0) > cap or options.min_frames > cap:
        raise InvalidRequestError(f"mm_processor_kwargs asks for more than {cap} frames per video",
                                  param=_PARAM)
    options = options.model_copy(update={"max_frames": min(options.max_frames, cap)})
    resolved = {**options.model_dump(), "min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}
    if model.frames_as_images:  # no video pixel bounds: the image processor sizes each frame
        resolved.update(min_pixels=None, max_pixels=None)
    return cfg, options, resolved


def limits_of(config: RouterConfig) -> VideoLimits:
    side = max(config.max_video_frame_pixels, 1)
    return VideoLimits(max_bytes=config.max_video_bytes, max_duration_s=config.max_video_duration_s,
                       max_frames=config.max_video_frames, max_width=side, max_height=side,
                       max_pixels=config.max_video_frame_pixels)


def probe_video(data: bytes, param: str, model: VideoModel, cfg: VideoProcessorConfig, options: SamplingOptions,
                resolved: dict[str, Any], limits: VideoLimits) -> VideoTokens:
    """Demux (no decoding), sample, count: the video's placeholder run. Runs in a thread."""
    try:
        index = index_video(data, limits)
        frames = sample_frame_indices(index.total_num_frames, index.fps, cfg.temporal_patch_size, options)
        if not frames:
            raise EmptyVideoError("the video has no frames to sample")
        grid = cfg.grid_thw(len(frames), index.height, index.width)
    except VideoError as exc:
        raise InvalidRequestError(str(exc), param=param, code=_code(exc)) from None
    except (PromptError, ValueError) as exc:
        raise InvalidRequestError(f"cannot use this video: {exc}", param=param, code="invalid_video") from None
    spgt = None
    if model.uses_seconds_per_grid:
        spgt = second_per_grid_t(len(frames), index.total_num_frames, index.fps, cfg.temporal_patch_size)
    return VideoTokens(grid, video_key(data, resolved), index.width, index.height, spgt, options=resolved)


def video_key(data: bytes, resolved: dict[str, Any]) -> str:
    """The MM cache key of a video item (triptych.stage_protocol.video_content_key)."""
    return video_content_key(data, VideoOptions.model_validate(resolved))


def _code(exc: VideoError) -> str:
    if isinstance(exc, VideoTooLongError):
        return "video_too_long"
    if isinstance(exc, VideoTooLargeError):
        return "video_too_large"
    if isinstance(exc, UnsupportedCodecError):
        return "unsupported_video_codec"
    if isinstance(exc, EmptyVideoError):
        return "empty_video"
    return "invalid_video"


