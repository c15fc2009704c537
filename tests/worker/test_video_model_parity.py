"""Video preprocessing and encoding for Qwen2-VL / Qwen2.5-VL against transformers (fp32):
`pixel_values_videos` bit-identical to transformers' patchify arithmetic, the processor
settings read as transformers reads them, video embeddings equal to the HF model's
`get_video_features`, and greedy tokens of our engine equal to HF `generate` for a decoded
video, alone and with an image in the same prompt."""

from __future__ import annotations

import ast
import copy
import json
import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_model, hf_processor, make_test_image

from triptych.processor import MultimodalProcessor, PromptError
from triptych.sampling_params import SamplingParams
from triptych.tiny_model import tiny_model_path
from triptych.video_processing import (
    VideoProcessorConfig,
    VideoTokens,
    expand_videos,
    preprocess_frames,
    preprocess_segments,
)
from triptych.worker.engine import Engine, EngineConfig, Request
from triptych.worker.models import load_model
from worker.video import CollaborativeDecoder, SamplingOptions, second_per_grid_t, video_id
from worker.video.synthetic import make_clip, sequential_decode

QWEN = ("qwen2-vl", "qwen2.5-vl")
VIDEO_SRC = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models; a loaded 2-core machine (see test_engine_parity)
    yield
    torch.set_num_threads(before)


def _hf_patchify():
    """transformers' `Qwen2VLVideoProcessor.patchify`, lifted from its source (the module
    imports torchvision, which cannot be installed here)."""
    tree = ast.parse(VIDEO_SRC.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    namespace = {"torch": torch}
    exec(compile(ast.Module([fn], []), str(VIDEO_SRC), "exec"), namespace)
    return namespace["patchify"]


def _hf_pixel_values(frames: np.ndarray, cfg: VideoProcessorConfig) -> tuple[torch.Tensor, list[int]]:
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]  # [1, n, C, H, W] uint8
    # image_processing_backends.TorchvisionBackend.rescale_and_normalize (fused) with
    # _fuse_mean_std_and_rescale_factor; torchvision's normalize is sub_(mean).div_(std).
    mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
    video = (video.to(torch.float32) - mean[:, None, None]) / std[:, None, None]
    patches, t, h, w = _hf_patchify()(None, video, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    return patches[0], [t, h, w]


@cache
def _clip() -> bytes:
    # 48 frames at 24 fps, 112x56: inside the tiny checkpoints' pixel bounds, no resize.
    return make_clip(48, width=112, height=56, fps=24, codec="libx264", gop=12, b_frames=2, seed=3)


@cache
def _decoded(fps: float = 2.0):
    with CollaborativeDecoder(num_decoders=2) as pool:
        return pool.decode(_clip(), temporal_patch_size=2, options=SamplingOptions(fps=fps), timeout=60)


def test_config_reads_like_transformers(tmp_path: Path) -> None:
    cfg = VideoProcessorConfig.from_pretrained(tiny_model_path("qwen2-vl"))
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (
        3136, 12544, 14, 2, 2)
    assert (cfg.fps, cfg.min_frames, cfg.max_frames) == (2.0, 4, 768)
    # video_preprocessor_config.json wins over preprocessor_config.json; a nested
    # processor_config.json "video_processor" wins over both; no size -> the video defaults.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 1, "max_pixels": 2}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": {
        "shortest_edge": 100, "longest_edge": 200}, "fps": 1.0, "max_frames": 64}))
    cfg = VideoProcessorConfig.from_pretrained(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.fps, cfg.max_frames) == (100, 200, 1.0, 64)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"temporal_patch_size": 2}}))
    cfg = VideoProcessorConfig.from_pretrained(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels) == (128 * 28 * 28, 28 * 28 * 768)
    assert cfg.with_pixel_bounds(max_pixels=200000).max_pixels == 200000
    for lo, hi in ((0, 10), (100, 10), (1.5, 10)):
        with pytest.raises(PromptError):
            cfg.with_pixel_bounds(lo, hi)
    assert cfg.sampling_defaults() == {"fps": 2.0, "min_frames": 4, "max_frames": 768}


@pytest.mark.parametrize("num_frames", [4, 5, 1])
def test_pixel_values_videos_bit_identical_to_transformers(num_frames: int) -> None:
    cfg = VideoProcessorConfig.from_pretrained(tiny_model_path("qwen2-vl"))
    frames = sequential_decode(_clip())[5:5 + num_frames]
    ours = preprocess_frames(frames, cfg)
    ref, grid = _hf_pixel_values(frames, cfg)
    assert list(ours.grid_thw) == grid == [math.ceil(num_frames / 2), 4, 8]
    assert torch.equal(torch.from_numpy(ours.pixel_values_videos), ref)
    assert cfg.num_tokens(num_frames, 56, 112) == ours.grid_thw[0] * 8


def test_segmentwise_patches_equal_whole_video_patches() -> None:
    cfg = VideoProcessorConfig.from_pretrained(tiny_model_path("qwen2-vl"))
    frames = sequential_decode(_clip())[:8]
    whole = preprocess_frames(frames, cfg)
    for cuts in ([2], [2, 4], [4, 6]):
        parts = np.split(frames, cuts)
        seg = preprocess_segments(parts, cfg)
        assert seg.grid_thw == whole.grid_thw and np.array_equal(seg.pixel_values_videos, whole.pixel_values_videos)
    with pytest.raises(ValueError):
        preprocess_segments(np.split(frames, [3]), cfg)  # a temporal patch would straddle the cut
    # The collaborative decoder's own segments (Fig. 7b alignment) patchify independently.
    decoded = _decoded(7.0)
    assert len(decoded.segments) > 1
    per_segment = preprocess_segments([s.frames for s in decoded.segments], cfg)
    assert np.array_equal(per_segment.pixel_values_videos, preprocess_frames(decoded.frames(), cfg).pixel_values_videos)


def test_resize_to_pixel_bounds_uses_smart_resize() -> None:
    cfg = VideoProcessorConfig.from_pretrained(tiny_model_path("qwen2-vl"))
    frames = np.zeros((3, 300, 500, 3), np.uint8)
    out = preprocess_frames(frames, cfg)
    h, w = cfg.resized_size(300, 500)
    assert h * w <= cfg.max_pixels and h % 28 == 0 and w % 28 == 0
    assert out.grid_thw == (2, h // 14, w // 14) == cfg.grid_thw(3, 300, 500)
    with pytest.raises(PromptError):
        preprocess_frames(np.zeros((0, 56, 56, 3), np.uint8), cfg)


@cache
def _model(family: str):
    return load_model(tiny_model_path(family), vision=True, language=True)


@pytest.mark.parametrize("family", QWEN)
def test_video_embeddings_match_transformers(family: str) -> None:
    cfg = VideoProcessorConfig.from_pretrained(tiny_model_path(family))
    patches = preprocess_frames(_decoded().frames(), cfg)
    ours = _model(family).vision.encode([_model(family).vision.video_input(patches.pixel_values_videos,
                                                                            patches.grid_thw)])[0]
    hf = hf_model(str(tiny_model_path(family)))
    with torch.inference_mode():
        ref = hf.model.get_video_features(torch.from_numpy(patches.pixel_values_videos),
                                          torch.tensor([patches.grid_thw])).pooler_output[0]
    assert ours.shape == ref.shape == (patches.grid_thw[0] * 8, _model(family).spec.hidden_size)
    assert (ours - ref).abs().max() < 1e-4


def _messages(with_image: bool) -> list[dict]:
    content = [{"type": "video"}, {"type": "text", "text": "What happens in this clip?"}]
    if with_image:
        content = [{"type": "image"}, *content]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("with_image", [False, True])
@pytest.mark.parametrize("family", QWEN)
def test_greedy_tokens_match_transformers_generate(family: str, with_image: bool) -> None:
    model_dir = tiny_model_path(family)
    cfg = VideoProcessorConfig.from_pretrained(model_dir)
    # 7 fps of a 48-frame 24 fps clip: 14 frames, grid t = 7, and Qwen2.5-VL's seconds per
    # grid step 2 / 7 (not 1: a wrong temporal spacing would change the tokens).
    decoded = _decoded(7.0)
    patches = preprocess_frames(decoded.frames(), cfg)
    index = decoded.index
    spgt = second_per_grid_t(len(decoded.frame_indices), index.total_num_frames, index.fps, 2)
    assert patches.grid_thw[0] == 7 and spgt == pytest.approx(2 / 7)
    images = [make_test_image(11, 84, 56)] if with_image else []

    # Ours: the processor expands images, then videos; the engine encodes the given video patches.
    proc = MultimodalProcessor.from_pretrained(model_dir)
    video_token = hf_processor(str(model_dir)).tokenizer.convert_tokens_to_ids("<|video_pad|>")
    prompt = expand_videos(proc.process(_messages(with_image), images), video_token, cfg.merge_size, [
        VideoTokens(patches.grid_thw, video_id(_clip()), index.width, index.height,
                    spgt if family == "qwen2.5-vl" else None)])
    engine = Engine(EngineConfig(model=str(model_dir), max_num_seqs=1))
    images_in = {it.content_hash: img.image
                 for it, img in zip([i for i in prompt.mm_items if i.kind == "image"], prompt.images, strict=True)}
    # Until the engine learns videos (the integration round), a video rides as a ready
    # vision input: admission skips preprocessing for hashes in `vision_inputs`, and the
    # scheduler only checks that `images` names the hash.
    images_in[video_id(_clip())] = patches
    request = Request("v", prompt.token_ids, SamplingParams(temperature=0.0, max_tokens=12),
                      mm_items=prompt.mm_items, images=images_in)
    request.vision_inputs[video_id(_clip())] = engine.vision.video_input(patches.pixel_values_videos, patches.grid_thw)
    (done,) = engine.generate_batch([request])
    assert done.error is None

    # transformers: its tokenizer, chat template and image processor; the video run expanded
    # the way Qwen2VLProcessor.replace_video_token does; mm_token_type_ids video = 2.
    hf_proc = hf_processor(str(model_dir))
    text = hf_proc.apply_chat_template(_messages(with_image), tokenize=False, add_generation_prompt=True)
    text = text.replace("<|video_pad|>", "<|video_pad|>" * (math.prod(patches.grid_thw) // 4))
    image_only = copy.copy(hf_proc)
    image_only.video_token = None  # its video check would refuse the run we expanded ourselves
    inputs = dict(image_only(text=[text], images=images or None, return_tensors="pt"))
    ids = inputs["input_ids"]
    assert ids[0].tolist() == prompt.token_ids
    image_token = hf_proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs["mm_token_type_ids"] = (ids == image_token).long() + 2 * (ids == video_token).long()
    inputs["pixel_values_videos"] = torch.from_numpy(patches.pixel_values_videos)
    inputs["video_grid_thw"] = torch.tensor([patches.grid_thw])
    if family == "qwen2.5-vl":
        inputs["second_per_grid_ts"] = torch.tensor([spgt])
    with torch.inference_mode():
        out = hf_model(str(model_dir)).generate(**inputs, max_new_tokens=12, do_sample=False, num_beams=1)
    expected = out[0, ids.shape[1]:].tolist()
    assert len(expected) > 0 and done.output_token_ids == expected


def test_expand_videos_moves_image_items() -> None:
    proc = MultimodalProcessor.from_pretrained(tiny_model_path("qwen2-vl"))
    video_token = proc.tokenizer.token_to_id("<|video_pad|>")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "x"}]}]
    base = proc.process(messages, [make_test_image(1, 56, 56)])
    (image,) = base.mm_items
    out = expand_videos(base, video_token, 2, [VideoTokens((2, 4, 8), "h", 112, 56)])
    video, moved = out.mm_items
    assert (video.kind, video.length, moved.kind) == ("video", 16, "image")
    assert moved.offset == image.offset + 15 and out.token_ids[video.offset:video.offset + 16] == [video_token] * 16
    with pytest.raises(PromptError):
        expand_videos(base, video_token, 2, [])

