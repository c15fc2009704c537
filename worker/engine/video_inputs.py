"""A video item's bytes -> the vision tower's input, on the instance that encodes it.

Without a V instance the encode-capable instance decodes the video itself: a
`CollaborativeDecoder` (FlashCodec §3.2-3.3, paper 000: GOP-aligned segments over a few
single-threaded decoder threads) samples exactly the frames the router counted (the
request's resolved `VideoOptions`), `triptych.video_processing` patchifies them with the
same pixel bounds, and `QwenVisionModel.video_input` wraps the patches. The token count
is checked against the item's placeholder run: a mismatch is a 400, never a garbled answer.

With video decoder services (`TRIPTYCH_VIDEO_DECODERS=url,url`: worker/video/service.py,
the V instance's work) the pool also holds one `RemoteSlot` per service, so one video's
GOP sets decode on this instance and the services at once (stall-free: a free slot takes
the next set). That list is static configuration; V instances in the topology
(`triptych worker --role V`) are driven by the router instead, and their patches arrive as
pulled parts (`from_parts`, worker/video_pull.py).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image
from prometheus_client import Counter

from triptych.processor import ProcessorError
from triptych.stage_protocol import frame_content_key
from triptych.video_processing import VideoProcessorConfig, frames_from_patches, preprocess_frames
from triptych.worker.engine.request import RequestValidationError
from triptych.worker.transfer.base import registry_metric
from triptych.worker.video import CollaborativeDecoder, LocalSlot, SamplingOptions, VideoError, VideoLimits
from triptych.worker.video.remote import RemoteSlot

VIDEOS_DECODED: Counter = registry_metric(
    Counter, "triptych_worker_videos_decoded_total", "Videos decoded on this instance, by where they were decoded",
    ["where"])
DECODERS = 2  # decoder threads per instance: PyAV releases the GIL, so they run in parallel
DECODE_TIMEOUT_S = 120.0
DECODERS_ENV = "TRIPTYCH_VIDEO_DECODERS"


class InvalidVideoInputError(RequestValidationError):
    """A video the encoder cannot decode, or whose decoded frames do not fill its placeholder run."""


class VideoInputs:
    """Decodes and preprocesses video items for one engine's vision tower."""

    def __init__(self, model_dir: str, vision: Any, remote_urls: list[str] | None = None) -> None:
        self.vision = vision
        self._model_dir = model_dir
        if remote_urls is None:
            remote_urls = [u.strip() for u in os.environ.get(DECODERS_ENV, "").split(",") if u.strip()]
        self.remote_urls = remote_urls
        self._config: VideoProcessorConfig | None = None
        self._pool: CollaborativeDecoder | None = None
        self._lock = threading.Lock()

    def _setup(self) -> tuple[VideoProcessorConfig, CollaborativeDecoder]:
        with self._lock:  # built at the first video: text and image instances never pay for it
            if self._config is None:
                self._config = VideoProcessorConfig.from_pretrained(self._model_dir)
            if self._pool is None:
                slots = [RemoteSlot(u, timeout_s=DECODE_TIMEOUT_S) for u in self.remote_urls]
                self._pool = CollaborativeDecoder(slots=[*slots, *(LocalSlot() for _ in range(DECODERS))])
            return self._config, self._pool

    def prepare(self, data: bytes, item: Any) -> Any:
        """The `VisionInput` of one video item (MMItemSpec or processor.MMItem)."""
        if not hasattr(self.vision, "video_input"):
            raise InvalidVideoInputError("this model takes no video input")
        frames, config = self._decode(data, item)
        try:
            patches = preprocess_frames(frames, config)
        except (ProcessorError, ValueError) as exc:
            raise InvalidVideoInputError(f"video {item.content_hash[:16]}: {exc}") from exc
        return self._wrap(patches.pixel_values_videos, patches.grid_thw, item)

    def prepare_frames(self, data: bytes, items: Sequence[Any]) -> dict[str, Any]:
        """A video taken as images (LLaVA): decode it once, exactly as a video (the same
        sampling, the same collaborative decoder), then each sampled frame is one image
        item's input (`frame_inputs`). `items`: the frame items of that one video."""
        frames, _ = self._decode(data, items[0])
        return self.frame_inputs(frames, items)

    def _decode(self, data: bytes, item: Any) -> tuple[Any, VideoProcessorConfig]:
        """The sampled RGB frames [n, H, W, 3] of a video item and its processor config."""
        options = _options(item)
        config, pool = self._setup()
        name = getattr(getattr(item, "frame", None), "video", None) or item.content_hash
        try:
            config = config.with_pixel_bounds(options.get("min_pixels"), options.get("max_pixels"))
            sampling = SamplingOptions.from_request(
                {k: v for k, v in options.items() if k in SamplingOptions.model_fields}, config.sampling_defaults())
            video = pool.decode(bytes(data), config.temporal_patch_size, sampling, VideoLimits(),
                                timeout=DECODE_TIMEOUT_S)
            frames = video.frames()
        except (VideoError, ProcessorError, ValueError) as exc:
            raise InvalidVideoInputError(f"video {name[:16]}: {exc}") from exc
        except TimeoutError as exc:
            raise InvalidVideoInputError(f"video {name[:16]} did not decode in {DECODE_TIMEOUT_S:g}s") from exc
        # A failing decoder service raises RemoteDecoderError (a RuntimeError): ours, a 500.
        VIDEOS_DECODED.labels("encoder+v" if self.remote_urls else "encoder").inc()
        return frames, config

    def frame_inputs(self, frames: Any, items: Sequence[Any]) -> dict[str, Any]:
        """Each frame item's `VisionInput`: its sampled frame through the checkpoint's image
        processor, exactly as an image (`vision.preprocess`). The frames must be the ones
        the router counted (as many, the keys derived from the video's)."""
        out: dict[str, Any] = {}
        for item in items:
            frame = item.frame
            if frame.count != len(frames) or frame.index >= len(frames):
                raise InvalidVideoInputError(
                    f"video {frame.video[:16]} decodes to {len(frames)} sampled frames; its placeholders are "
                    f"for {frame.count} (frame {frame.index})")
            if item.content_hash != frame_content_key(frame.video, frame.index):
                raise InvalidVideoInputError(f"frame item {item.content_hash[:16]} is not frame {frame.index} "
                                             f"of video {frame.video[:16]}")
            vin = self.vision.preprocess(Image.fromarray(np.ascontiguousarray(frames[frame.index])))
            if vin.num_tokens != item.length:
                raise InvalidVideoInputError(f"frame {frame.index} of video {frame.video[:16]} gives "
                                             f"{vin.num_tokens} visual tokens but its placeholder run has {item.length}")
            out[item.content_hash] = vin
        return out

    def frames_from_parts(self, rows: Any, grid_thw: tuple[int, int, int]) -> Any:
        """The RGB frames of a video taken as images, decoded on V instances (pulled rows)."""
        if not self._setup()[0].frames_as_images:
            raise InvalidVideoInputError("this model takes videos as video input, not as frames")
        try:
            frames = frames_from_patches(np.asarray(rows), grid_thw)
        except ProcessorError as exc:
            raise InvalidVideoInputError(str(exc)) from exc
        VIDEOS_DECODED.labels("v").inc()
        return frames

    @property
    def patch_dim(self) -> int:
        """Width of one pixel patch row (C * T * P * P), as V instances write them."""
        c = self._setup()[0]
        return 3 * c.temporal_patch_size * c.patch_size * c.patch_size

    def from_parts(self, pixel_values: Any, grid_thw: tuple[int, int, int], item: Any) -> Any:
        """The `VisionInput` of a video decoded and patchified on V instances (pulled parts)."""
        if not hasattr(self.vision, "video_input"):
            raise InvalidVideoInputError("this model takes no video input")
        VIDEOS_DECODED.labels("v").inc()
        return self._wrap(pixel_values, grid_thw, item)

    def _wrap(self, pixel_values: Any, grid_thw: tuple[int, int, int], item: Any) -> Any:
        """Wrap the patches; their token count must fill the item's placeholder run exactly."""
        try:
            vin = self.vision.video_input(pixel_values, grid_thw)
        except ValueError as exc:
            raise InvalidVideoInputError(f"video {item.content_hash[:16]}: {exc}") from exc
        if vin.num_tokens != item.length or (item.grid_thw is not None
                                             and tuple(item.grid_thw) != tuple(grid_thw)):
            raise InvalidVideoInputError(
                f"video {item.content_hash[:16]} gives grid {tuple(grid_thw)} ({vin.num_tokens} tokens) but its "
                f"placeholder run has {item.length} tokens (grid {item.grid_thw})")
        return vin

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def _options(item: Any) -> dict[str, Any]:
    video = getattr(item, "video", None)  # stage_protocol.MMItemSpec
    if video is not None and hasattr(video, "model_dump"):
        return {k: v for k, v in video.model_dump().items() if v is not None}
    opts = getattr(item, "video_options", None)  # processor.MMItem
    if isinstance(opts, Mapping):
        return {k: v for k, v in opts.items() if v is not None}
    return {}
