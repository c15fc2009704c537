"""A video taken as images (LLaVA) on the encode instance: decoded once with the video
path's sampling (temporal patch 1), each sampled frame one image item's input, in frame
order, and the engine's greedy tokens equal transformers' `LlavaForConditionalGeneration`
fed those frames as images; V-instance rows carry the RGB frames bit for bit; a run whose
frame items do not match the decoded frames is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from videokit import VideoCase, clip, expected_ids

from triptych.processor import ImageInput, MultimodalProcessor
from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import MMItemSpec, VideoFrame, VideoOptions, frame_content_key, video_content_key
from triptych.video_processing import (
    VideoProcessorConfig,
    frames_from_patches,
    preprocess_frames,
    preprocess_segments,
)
from triptych.worker.engine import Engine, EngineConfig, Request
from triptych.worker.engine.video_inputs import VIDEOS_DECODED, InvalidVideoInputError, VideoInputs
from triptych.worker.video import SamplingOptions, index_video, sample_frame_indices
from triptych.worker.video.synthetic import sequential_decode


@dataclass
class _Input:
    frame: np.ndarray
    num_tokens: int = 16


class _Vision:
    """Stands in for LlavaVisionModel.preprocess: records the image it was given."""

    def preprocess(self, image: Any) -> _Input:
        return _Input(np.asarray(image))


def _items(key: str, count: int, length: int = 16) -> list[MMItemSpec]:
    return [MMItemSpec(offset=i * (length + 1), length=length, content_hash=frame_content_key(key, i),
                       video=VideoOptions(fps=3.0), frame=VideoFrame(video=key, index=i, count=count))
            for i in range(count)]


def _sampled(data: bytes, fps: float) -> np.ndarray:
    index = index_video(data)
    cfg = VideoProcessorConfig.for_frames_as_images()
    frames = sample_frame_indices(index.total_num_frames, index.fps, 1,
                                  SamplingOptions.from_request({"fps": fps}, cfg.sampling_defaults()))
    return sequential_decode(data)[frames]


def test_llava_checkpoint_reads_the_frames_as_images_config(llava_dir, qwen2_vl_dir) -> None:
    cfg = VideoProcessorConfig.from_pretrained(llava_dir)
    assert cfg.frames_as_images and cfg.temporal_patch_size == 1 and not cfg.do_resize
    assert not VideoProcessorConfig.from_pretrained(qwen2_vl_dir).frames_as_images


def test_rows_carry_the_rgb_frames_bit_for_bit() -> None:
    frames = _sampled(clip(3), 7.0)
    cfg = VideoProcessorConfig.for_frames_as_images()
    whole = preprocess_frames(frames, cfg)
    assert whole.grid_thw == (14, 56, 112) and whole.pixel_values_videos.shape == (14 * 56 * 112, 3)
    assert np.array_equal(frames_from_patches(whole.pixel_values_videos, whole.grid_thw), frames)
    parts = preprocess_segments([frames[:5], frames[5:]], cfg)  # odd cut: temporal patch 1, no alignment
    assert np.array_equal(parts.pixel_values_videos, whole.pixel_values_videos)


def test_encoder_decodes_once_and_feeds_each_frame_as_an_image(llava_dir) -> None:
    data = clip(4)
    key = video_content_key(data, VideoOptions(fps=3.0))
    videos = VideoInputs(str(llava_dir), _Vision())
    try:
        inputs = videos.prepare_frames(data, _items(key, 6))
    finally:
        videos.close()
    want = _sampled(data, 3.0)
    assert len(want) == 6 and list(inputs) == [frame_content_key(key, i) for i in range(6)]
    for i, vin in enumerate(inputs.values()):
        assert np.array_equal(vin.frame, want[i]), i


@pytest.mark.parametrize("bad", ["count", "key", "length"])
def test_frame_items_that_do_not_match_the_video_are_refused(bad: str) -> None:
    frames = _sampled(clip(3), 3.0)
    key = "k" * 64
    items = _items(key, 6)
    if bad == "count":
        items = _items(key, 7)
    elif bad == "key":
        items[2] = items[2].model_copy(update={"content_hash": frame_content_key(key, 3)})
    else:
        items = _items(key, 6, length=15)
    videos = VideoInputs("unused", _Vision())
    with pytest.raises(InvalidVideoInputError):
        videos.frame_inputs(frames, items)


@pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py
def test_engine_takes_a_video_as_frames_like_transformers(llava_dir) -> None:
    """The request as the router builds it (tests/router/test_router_video.py checks that):
    the image, then the video's 6 frames as images keyed from the video's key; the video's
    bytes given once, under that key."""
    case = VideoCase(seed=4, fps=3.0, with_image=True, stream=False)
    opts = VideoOptions(fps=3.0, min_frames=4, max_frames=768)
    key = video_content_key(case.video, opts)
    n = 6
    proc = MultimodalProcessor.from_pretrained(llava_dir)
    image = ImageInput.from_pil(case.image)
    frames = [ImageInput(None, frame_content_key(key, i), 112, 56) for i in range(n)]
    content = [*[{"type": "image"}] * (1 + n), {"type": "text", "text": case.prompt}]
    prompt = proc.process([{"role": "user", "content": content}], [image, *frames])
    items = [MMItemSpec.of(m) for m in prompt.mm_items]
    items[1:] = [it.model_copy(update={"frame": VideoFrame(video=key, index=i, count=n), "video": opts})
                 for i, it in enumerate(items[1:])]
    engine = Engine(EngineConfig(model=str(llava_dir), max_num_seqs=1))
    before = VIDEOS_DECODED.labels("encoder")._value.get()
    req = Request("v", prompt.token_ids, SamplingParams(temperature=0.0, max_tokens=case.max_tokens),
                  mm_items=items, images={image.content_hash: case.image, key: case.video})
    (done,) = engine.generate_batch([req])
    assert done.error is None
    assert done.output_token_ids == expected_ids(llava_dir, case)
    assert VIDEOS_DECODED.labels("encoder")._value.get() == before + 1  # one decode for 6 frames


def test_rgb_rows_get_large_blocks_and_round_trip() -> None:
    from triptych.stage_protocol import video_rows_per_block
    from triptych.worker.video_buffer import VideoBuffer

    assert video_rows_per_block(1176) == 64  # Qwen's 14x14x2x3 patches: unchanged
    assert video_rows_per_block(3) == 64 * 392  # one RGB pixel a row: the same bytes per block
    frames = _sampled(clip(3), 3.0)
    rows = preprocess_frames(frames, VideoProcessorConfig.for_frames_as_images()).pixel_values_videos
    buffer = VideoBuffer(3, 4 << 20)
    ids = buffer.reserve(len(rows))
    assert len(ids) == buffer.blocks_for(len(rows)) == 2  # 6 frames of 112x56: 37,632 rows
    buffer.write(ids, rows)
    assert np.array_equal(frames_from_patches(buffer.read(ids, len(rows)), (6, 56, 112)), frames)
