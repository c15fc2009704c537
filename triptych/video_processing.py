"""Qwen2-VL / Qwen2.5-VL video preprocessing: sampled RGB frames -> `pixel_values_videos`,
`video_grid_thw`, Qwen2.5-VL's `second_per_grid_ts`, and the prompt's video placeholder runs.

Torch-free (numpy) so the router can count video tokens and a V instance can build pixel
patches without loading a model. The arithmetic is transformers' `Qwen2VLVideoProcessor`
(transformers 5.23.0, models/qwen2_vl/video_processing_qwen2_vl.py): `smart_resize` to the
pixel bounds with factor patch_size * merge_size, the fused rescale-and-normalize
(`(x - mean * 255) / (std * 255)` in float32, image_processing_backends.py
`_fuse_mean_std_and_rescale_factor`), and `patchify` (pad with the last frame to a multiple
of temporal_patch_size, the same view/permute), which makes the result bit-identical to
transformers' where no resize is needed. Resizing uses PIL's bicubic filter where
transformers uses torchvision's (not installable here): equal up to rounding.

Settings are read as transformers reads them (`BaseVideoProcessor.get_video_processor_dict`):
processor_config.json's "video_processor", else video_preprocessor_config.json, else the
image processor's preprocessor_config.json; `min_pixels`/`max_pixels` there override `size`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from triptych.processor import MMItem, ProcessedPrompt, PromptError, smart_resize

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen2VLVideoProcessor.size: the video defaults differ from the image processor's.
DEFAULT_MIN_PIXELS = 128 * 28 * 28
DEFAULT_MAX_PIXELS = 28 * 28 * 768
DEFAULT_FPS = 2.0  # Qwen's tooling (qwen-vl-utils) and vLLM's Qwen video default
# Checkpoints with no video input of their own: each sampled frame is fed as one image.
FRAMES_AS_IMAGES_MODEL_TYPES = ("llava",)


@dataclass(frozen=True)
class VideoProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    # Sampling defaults (transformers' class attributes; fps from Qwen's tooling).
    fps: float = DEFAULT_FPS
    min_frames: int = 4
    max_frames: int = 768
    # LLaVA takes a video's sampled frames as images: the "patches" are then the RGB frames
    # themselves, one pixel per row (see `frames_as_images`).
    frames_as_images: bool = False

    @classmethod
    def for_frames_as_images(cls) -> VideoProcessorConfig:
        """The config of a model that takes a video's sampled frames as images (LLaVA).
        The temporal patch size is 1 (no temporal merge), so sampling floors the frame count
        to a multiple of 1 and GOP sets need no alignment. Patches are 1x1 pixels, neither
        resized, rescaled nor normalized: `preprocess_frames` then yields the frames as they
        were decoded ([n*H*W, 3] float32, exact for uint8), which is what a V instance hands
        the encode instance; there each frame goes through the checkpoint's own image
        processor, as an image does (pixel bounds are the image processor's: a fixed size)."""
        return cls(patch_size=1, temporal_patch_size=1, merge_size=1, min_pixels=1, max_pixels=2**62,
                   do_resize=False, do_rescale=False, do_normalize=False, frames_as_images=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoProcessorConfig:
        """The settings of a processor dict, as `Qwen2VLVideoProcessor.__init__` applies them."""
        size = d.get("size") or {}
        min_pixels = d.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS
        max_pixels = d.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
        base = cls()
        return cls(
            patch_size=int(d.get("patch_size") or base.patch_size),
            temporal_patch_size=int(d.get("temporal_patch_size") or base.temporal_patch_size),
            merge_size=int(d.get("merge_size") or base.merge_size),
            min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            image_mean=tuple(d.get("image_mean") or base.image_mean),
            image_std=tuple(d.get("image_std") or base.image_std),
            rescale_factor=float(d.get("rescale_factor") or base.rescale_factor),
            do_resize=bool(d.get("do_resize", True)), do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            fps=float(d.get("fps") or DEFAULT_FPS),
            min_frames=int(d.get("min_frames") or base.min_frames),
            max_frames=int(d.get("max_frames") or base.max_frames),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VideoProcessorConfig:
        model_dir = Path(model_dir)
        if _read_json(model_dir / "config.json").get("model_type") in FRAMES_AS_IMAGES_MODEL_TYPES:
            return cls.for_frames_as_images()
        nested = _read_json(model_dir / "processor_config.json").get("video_processor")
        if isinstance(nested, dict):
            return cls.from_dict(nested)
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (model_dir / name).is_file():
                return cls.from_dict(_read_json(model_dir / name))
        raise FileNotFoundError(f"{model_dir}: no video or image preprocessor config")

    def with_pixel_bounds(self, min_pixels: int | None = None, max_pixels: int | None = None) -> VideoProcessorConfig:
        """Per-request bounds (vLLM-style `mm_processor_kwargs`); bad ones are a PromptError (400)."""
        lo = self.min_pixels if min_pixels is None else min_pixels
        hi = self.max_pixels if max_pixels is None else max_pixels
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 < lo <= hi):
            raise PromptError(f"video pixel bounds must be integers with 0 < min_pixels <= max_pixels, got {lo}, {hi}")
        return replace(self, min_pixels=lo, max_pixels=hi)

    def sampling_defaults(self) -> dict[str, Any]:
        """The checkpoint's frame-sampling defaults, for `worker.video.SamplingOptions.from_request`."""
        return {"fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames}

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise PromptError(f"video frames {width}x{height} are not multiples of {self.factor}")
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid_thw(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for `num_frames` sampled frames of `height` x `width`."""
        resized_h, resized_w = self.resized_size(height, width)
        grid_t = math.ceil(num_frames / self.temporal_patch_size)
        return grid_t, resized_h // self.patch_size, resized_w // self.patch_size

    def num_tokens(self, num_frames: int, height: int, width: int) -> int:
        t, h, w = self.grid_thw(num_frames, height, width)
        return t * h * w // self.merge_size**2


@dataclass(frozen=True)
class VideoPatches:
    pixel_values_videos: np.ndarray  # [t * h * w, C * T * P * P] float32
    grid_thw: tuple[int, int, int]


def preprocess_frames(frames: np.ndarray | Sequence[np.ndarray], config: VideoProcessorConfig) -> VideoPatches:
    """Sampled RGB frames [n, H, W, 3] uint8 -> the video's pixel patches (see module doc)."""
    video = np.asarray(frames)
    if video.ndim != 4 or video.shape[-1] != 3 or len(video) == 0:
        raise PromptError(f"video frames must be [n, H, W, 3] with n >= 1, got {video.shape}")
    height, width = video.shape[1:3]
    resized_h, resized_w = config.resized_size(height, width)
    if (resized_h, resized_w) != (height, width):
        video = _resize(video, resized_h, resized_w)
    pixels = _rescale_and_normalize(video.transpose(0, 3, 1, 2), config)
    return _patchify(pixels, config)


def preprocess_segments(segments: Sequence[np.ndarray], config: VideoProcessorConfig) -> VideoPatches:
    """Patches of a video decoded in segments, computed segment by segment. Every segment
    but the last holds a multiple of temporal_patch_size frames (paper 000 Fig. 7b), so no
    temporal patch straddles two segments and the rows concatenate to the whole video's."""
    tps = config.temporal_patch_size
    for i, seg in enumerate(segments[:-1]):
        if len(seg) % tps:
            raise ValueError(f"segment {i} has {len(seg)} frames, not a multiple of {tps}")
    parts = [preprocess_frames(seg, config) for seg in segments]
    grids = {p.grid_thw[1:] for p in parts}
    if len(grids) != 1:
        raise PromptError("video segments resize to different frame sizes")
    t = sum(p.grid_thw[0] for p in parts)
    return VideoPatches(np.concatenate([p.pixel_values_videos for p in parts]), (t, *parts[0].grid_thw[1:]))


def frames_from_patches(rows: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
    """The RGB frames [n, H, W, 3] uint8 back from `preprocess_frames` rows of a
    `frames_as_images` config (grid (n, H, W), one pixel per row)."""
    n, height, width = grid_thw
    flat = np.asarray(rows)
    if flat.shape != (n * height * width, 3):
        raise PromptError(f"frame rows {flat.shape} do not hold {n} frames of {width}x{height}")
    return flat.reshape(n, height, width, 3).astype(np.uint8)


def _resize(video: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC))
                     for f in video])


def _rescale_and_normalize(video: np.ndarray, config: VideoProcessorConfig) -> np.ndarray:
    x = video.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)
        std = np.asarray(config.image_std, dtype=np.float32)
        if config.do_rescale:  # fused, as transformers: mean and std scaled by 1 / rescale_factor
            mean, std = mean * (1.0 / config.rescale_factor), std * (1.0 / config.rescale_factor)
        return (x - mean[:, None, None]) / std[:, None, None]
    if config.do_rescale:
        return x * np.float32(config.rescale_factor)
    return x


def _patchify(video: np.ndarray, config: VideoProcessorConfig) -> VideoPatches:
    """transformers' `Qwen2VLVideoProcessor.patchify` for one video [n, C, H, W]."""
    tps, patch, merge = config.temporal_patch_size, config.patch_size, config.merge_size
    if pad := -len(video) % tps:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    frames, channel, height, width = video.shape
    grid_t, grid_h, grid_w = frames // tps, height // patch, width // patch
    patches = video.reshape(grid_t, tps, channel, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(grid_t * grid_h * grid_w, channel * tps * patch * patch)
    return VideoPatches(np.ascontiguousarray(flat), (grid_t, grid_h, grid_w))


# --- prompt placeholders --------------------------------------------------------------


@dataclass(frozen=True)
class VideoTokens:
    """What a video's placeholder run needs: its grid and (Qwen2.5-VL) seconds per grid step."""

    grid_thw: tuple[int, int, int]
    content_hash: str
    width: int
    height: int
    second_per_grid_t: float | None = None
    options: Mapping[str, Any] | None = None  # the sampling/pixel options (MMItem.video_options)


def expand_videos(prompt: ProcessedPrompt, video_token_id: int, merge_size: int,
                  videos: Sequence[VideoTokens]) -> ProcessedPrompt:
    """Replace the i-th video placeholder token by video i's run of t*h*w/merge² tokens (as
    transformers' `Qwen2VLProcessor.replace_video_token`), after images were expanded;
    image items move by the tokens inserted before them."""
    ids = prompt.token_ids
    positions = [i for i, t in enumerate(ids) if t == video_token_id]
    if len(positions) != len(videos):
        raise PromptError(f"the prompt has {len(positions)} video placeholder(s) but {len(videos)} video(s) were given")
    out: list[int] = []
    items: list[MMItem] = []
    start = 0
    shifts: list[tuple[int, int]] = []  # (original position, tokens added before what follows it)
    for index, (pos, video) in enumerate(zip(positions, videos, strict=True)):
        out.extend(ids[start:pos])
        t, h, w = video.grid_thw
        length = t * h * w // merge_size**2
        items.append(MMItem(kind="video", index=index, offset=len(out), length=length, grid_thw=video.grid_thw,
                            content_hash=video.content_hash, width=video.width, height=video.height,
                            second_per_grid_t=video.second_per_grid_t, video_options=video.options))
        out.extend([video_token_id] * length)
        shifts.append((pos, len(out) - pos - 1))
        start = pos + 1
    out.extend(ids[start:])
    moved = [replace(item, offset=item.offset + _shift(item.offset, shifts)) for item in prompt.mm_items]
    return ProcessedPrompt(token_ids=out, mm_items=sorted(moved + items, key=lambda it: it.offset),
                           images=list(prompt.images))


def _shift(offset: int, shifts: list[tuple[int, int]]) -> int:
    added = 0
    for pos, total in shifts:
        if pos < offset:
            added = total
    return added


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
