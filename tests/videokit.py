"""Video requests for serving tests and their transformers reference (fp32).

transformers' video processor needs torchvision (not installable here), so the reference
`pixel_values_videos` come from `triptych.video_processing` (bit-identical to transformers'
arithmetic: tests/worker/test_video_model_parity.py) over a plain sequential PyAV decode
of the frames transformers' sampling picks; the HF model's `generate` runs on them."""

from __future__ import annotations

import base64
import copy
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from hf_reference import hf_generate, hf_model, hf_processor, make_test_image, png_bytes
from PIL import Image

from triptych.tiny_model import tiny_model_path
from triptych.video_processing import VideoProcessorConfig, preprocess_frames
from triptych.worker.video import SamplingOptions, index_video, sample_frame_indices, second_per_grid_t
from triptych.worker.video.synthetic import make_clip, sequential_decode


@cache
def clip(seed: int = 3, frames: int = 48) -> bytes:
    # 48 frames at 24 fps, 112x56: inside the tiny checkpoints' pixel bounds (no resize).
    return make_clip(frames, width=112, height=56, fps=24, codec="libx264", gop=12, b_frames=2, seed=seed)


@dataclass
class VideoCase:
    seed: int
    fps: float | None  # None: the server's default (2 fps)
    with_image: bool
    stream: bool
    max_tokens: int = 8
    prompt: str = "What happens in this clip?"

    @property
    def video(self) -> bytes:
        return clip(self.seed)

    @property
    def image(self) -> Any:
        return make_test_image(self.seed + 11, 84, 56)

    def hf_messages(self) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = [{"type": "video"}, {"type": "text", "text": self.prompt}]
        if self.with_image:
            content = [{"type": "image"}, *content]
        return [{"role": "user", "content": content}]

    def openai_body(self, model: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(self.video)}},
            {"type": "text", "text": self.prompt}]
        if self.with_image:
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                            + b64(png_bytes(self.image))}}, *content]
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": self.max_tokens,
                "temperature": 0, "stream": self.stream, "return_token_ids": True}
        if self.fps is not None:
            body["mm_processor_kwargs"] = {"fps": self.fps}
        return body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def expected_ids(model_dir: Path, case: VideoCase) -> list[int]:
    """transformers `generate` (greedy, fp32) on the case's prompt, image and video."""
    cfg = VideoProcessorConfig.from_pretrained(model_dir)
    index = index_video(case.video)
    options = SamplingOptions.from_request({"fps": case.fps} if case.fps else {}, cfg.sampling_defaults())
    frames = sample_frame_indices(index.total_num_frames, index.fps, cfg.temporal_patch_size, options)
    if cfg.frames_as_images:
        return _expected_frames_as_images(model_dir, case, sequential_decode(case.video)[frames])
    patches = preprocess_frames(sequential_decode(case.video)[frames], cfg)
    hf_proc = hf_processor(str(model_dir))
    text = hf_proc.apply_chat_template(case.hf_messages(), tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", "<|video_pad|>" * (math.prod(patches.grid_thw) // cfg.merge_size**2))
    image_only = copy.copy(hf_proc)
    image_only.video_token = None  # its video check would refuse the run expanded here
    inputs = dict(image_only(text=[text], images=[case.image] if case.with_image else None, return_tensors="pt"))
    ids = inputs["input_ids"]
    image_token = hf_proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_token = hf_proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    inputs["mm_token_type_ids"] = (ids == image_token).long() + 2 * (ids == video_token).long()
    inputs["pixel_values_videos"] = torch.from_numpy(patches.pixel_values_videos)
    inputs["video_grid_thw"] = torch.tensor([patches.grid_thw])
    if "qwen2_5" in hf_model(str(model_dir)).config.model_type:
        inputs["second_per_grid_ts"] = torch.tensor(
            [second_per_grid_t(len(frames), index.total_num_frames, index.fps, cfg.temporal_patch_size)])
    with torch.inference_mode():
        out = hf_model(str(model_dir)).generate(**inputs, max_new_tokens=case.max_tokens, do_sample=False,
                                                num_beams=1)
    return out[0, ids.shape[1]:].tolist()


def _expected_frames_as_images(model_dir: Path, case: VideoCase, frames: Any) -> list[int]:
    """LLaVA: transformers' `LlavaForConditionalGeneration` fed the sampled frames (temporal
    patch 1: transformers' sampling with the count rounded to a multiple of 1) as a list of
    images, in frame order, where the video part was."""
    content: list[dict[str, Any]] = []
    for part in case.hf_messages()[0]["content"]:
        content.extend([{"type": "image"}] * len(frames) if part["type"] == "video" else [part])
    images = [Image.fromarray(f) for f in frames]
    if case.with_image:
        images = [case.image, *images]
    return hf_generate(model_dir, [{"role": "user", "content": content}], images, case.max_tokens)


# The serving tests' requests: explicit and default fps, with and without an image, both modes.
SERVING_CASES = [
    VideoCase(seed=3, fps=7.0, with_image=False, stream=True),
    VideoCase(seed=4, fps=7.0, with_image=True, stream=False),
    VideoCase(seed=5, fps=None, with_image=False, stream=False),  # the default 2 fps
    VideoCase(seed=6, fps=None, with_image=True, stream=True),
]


@cache
def serving_expected(family: str) -> list[list[int]]:
    """The reference tokens of SERVING_CASES on the tiny checkpoint of `family`."""
    return [expected_ids(tiny_model_path(family), c) for c in SERVING_CASES]


def bad_video_body(model: str, data: bytes) -> dict[str, Any]:
    """A chat request whose one video is `data` (a clip the server should refuse)."""
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(data)}}
    return {"model": model, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
            "max_tokens": 4}


@cache
def undecodable_clip(seed: int = 3) -> bytes:
    """A clip whose container demuxes (the router counts its tokens) but whose frames after
    the first GOP are garbage: only decoding finds out (a V or encode instance's 400)."""
    good = bytearray(clip(seed))
    gops = index_video(bytes(good)).gops
    for i in range(gops[1].byte_offset, gops[-1].byte_offset):
        good[i] = 0xFF
    return bytes(good)
