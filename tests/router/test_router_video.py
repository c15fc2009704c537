"""video_url parts at the router: demuxed (never decoded) to count the tokens, placeholder
runs expanded after the images, the resolved sampling options carried to the encoder, and
every bad video or option a 400 with an OpenAI error body."""

from __future__ import annotations

import base64
from collections.abc import Callable
from functools import cache

import httpx
import pytest
from routerkit import ScriptedBackend, chat_body, image_part, solid_png

from triptych.processor import MultimodalProcessor
from triptych.router.api import create_app
from triptych.router.config import RouterConfig
from triptych.router.videos import video_key
from triptych.stage_protocol import MMItemSpec, frame_content_key
from triptych.worker.video import video_id
from triptych.worker.video.synthetic import audio_only_clip, make_clip


@cache
def clip(frames: int = 48) -> bytes:
    return make_clip(frames, width=112, height=56, fps=24, codec="libx264", gop=12, b_frames=2, seed=3)


def video_part(data: bytes, media: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}


async def test_video_is_counted_and_expanded(client: httpx.AsyncClient, backend: ScriptedBackend,
                                             qwen2_vl_dir) -> None:
    png = solid_png(56, 56)
    body = chat_body([image_part(png), video_part(clip()), {"type": "text", "text": "what happens?"}],
                     mm_processor_kwargs={"fps": 7})
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    (req,) = backend.requests
    image, video = req.mm_items
    assert (image.kind, video.kind) == ("image", "video")
    # 48 frames at 24 fps sampled at 7 fps: 14 frames, grid t 7; 112x56 -> 4x8 patches.
    assert video.grid_thw == (7, 4, 8) and video.length == 7 * 4 * 8 // 4
    assert req.images == [png, clip()]
    assert req.prompt_token_ids[video.offset:video.offset + video.length] == [
        req.prompt_token_ids[video.offset]] * video.length
    spec = MMItemSpec.of(video)
    assert spec.kind == "video" and spec.video is not None and spec.video.fps == 7
    assert spec.video.min_pixels == 3136 and spec.video.max_pixels == 12544


async def test_default_is_two_fps(client: httpx.AsyncClient, backend: ScriptedBackend) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body([video_part(clip())]))
    assert resp.status_code == 200, resp.text
    (video,) = backend.requests[0].mm_items
    assert video.grid_thw == (2, 4, 8)  # 2 s at 2 fps = 4 frames = 2 temporal patches
    assert MMItemSpec.of(video).video.fps == 2.0


async def test_cache_key_covers_the_sampling(client: httpx.AsyncClient, backend: ScriptedBackend) -> None:
    """The MM cache must not hand a 2 fps embedding to a 7 fps request of the same clip."""
    for kwargs in ({"fps": 2}, {"fps": 2.0}, {"fps": 7}, {"fps": 2, "max_pixels": 50000}):
        resp = await client.post("/v1/chat/completions", json=chat_body([video_part(clip())],
                                                                          mm_processor_kwargs=kwargs))
        assert resp.status_code == 200, resp.text
    keys = [r.mm_items[0].content_hash for r in backend.requests]
    assert keys[0] == keys[1] and len({keys[0], keys[2], keys[3]}) == 3
    assert video_id(clip()) not in keys




@pytest.mark.parametrize(("case", "code"), [
    ("truncated", "invalid_video"),
    ("not-a-video", "invalid_video"),
    ("unsupported-codec", "unsupported_video_codec"),
    ("too-long", "video_too_long"),
    ("too-large-pixels", "video_too_large"),
    ("too-large-bytes", "video_too_large"),
    ("zero-frames", "empty_video"),
    ("image-media-type", "invalid_image_url"),
])
async def test_bad_videos_are_400(case: str, code: str, config: RouterConfig, backend: ScriptedBackend,
                                  make_client: Callable[..., httpx.AsyncClient]) -> None:
    good = clip()
    data, limits, media = {
        "truncated": (good[: len(good) // 2], {}, "video/mp4"),
        "not-a-video": (b"this is not a video " * 50, {}, "video/mp4"),
        "unsupported-codec": (solid_png(32, 32), {}, "video/mp4"),
        "too-long": (good, {"max_video_duration_s": 1.0}, "video/mp4"),
        "too-large-pixels": (good, {"max_video_frame_pixels": 64 * 32}, "video/mp4"),
        "too-large-bytes": (good, {"max_video_bytes": len(good) - 10}, "video/mp4"),
        "zero-frames": (audio_only_clip(), {}, "video/x-matroska"),
        "image-media-type": (good, {}, "image/png"),
    }[case]
    async with make_client(config.model_copy(update=limits), backend) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body([video_part(data, media)]))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["code"] == code if case != "image-media-type" else "not a video type" in error["message"]
        assert error["param"] == "messages[0].content[0].video_url"
        assert not backend.requests
        if not limits:
            ok = await client.post("/v1/chat/completions", json=chat_body([video_part(good)]))
            assert ok.status_code == 200  # and the router keeps serving


@pytest.mark.parametrize("kwargs", [{"fps": 0}, {"fps": 2, "num_frames": 4}, {"bogus": 1},
                                    {"max_pixels": 10}, {"num_frames": 100_000}])
async def test_bad_mm_processor_kwargs_are_400(kwargs: dict, client: httpx.AsyncClient,
                                               backend: ScriptedBackend) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body([video_part(clip())],
                                                                      mm_processor_kwargs=kwargs))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "mm_processor_kwargs" and not backend.requests


async def test_too_many_videos(config: RouterConfig, backend: ScriptedBackend,
                               make_client: Callable[..., httpx.AsyncClient]) -> None:
    async with make_client(config.model_copy(update={"max_videos_per_request": 1}), backend) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body([video_part(clip()), video_part(clip())]))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "too_many_videos"


async def test_http_video_needs_the_allow_list(client: httpx.AsyncClient) -> None:
    part = {"type": "video_url", "video_url": {"url": "http://videos.example.com/a.mp4"}}
    resp = await client.post("/v1/chat/completions", json=chat_body([part]))
    assert resp.status_code == 400 and "disabled" in resp.json()["error"]["message"]


def _llava_client(llava_dir, backend: ScriptedBackend) -> httpx.AsyncClient:
    config = RouterConfig(model=llava_dir, served_model_name="tiny-qwen", max_model_len=512)
    app = create_app(config, backend, processor=MultimodalProcessor.from_pretrained(llava_dir))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


async def test_llava_takes_the_sampled_frames_as_images(llava_dir, backend: ScriptedBackend) -> None:
    from hf_reference import hf_prompt_ids, make_test_image

    png = solid_png(56, 56)
    body = chat_body([video_part(clip()), image_part(png), {"type": "text", "text": "what happens?"}],
                     mm_processor_kwargs={"fps": 3})
    async with _llava_client(llava_dir, backend) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    (req,) = backend.requests
    # 48 frames at 24 fps sampled at 3 fps: 6 frames (temporal patch 1: no rounding to pairs),
    # each one image run of the image processor's 16 tokens, in frame order, then the image.
    *frames, image = req.mm_items
    assert len(frames) == 6 and [f.kind for f in req.mm_items] == ["image"] * 7
    assert [f.frame_index for f in frames] == list(range(6)) and {f.frame_count for f in frames} == {6}
    assert {f.length for f in req.mm_items} == {16} and image.frame_of is None
    key = frames[0].frame_of
    assert {f.frame_of for f in frames} == {key} and key == video_key(clip(), frames[0].video_options)
    assert [f.content_hash for f in frames] == [frame_content_key(key, i) for i in range(6)]
    assert len({*[f.content_hash for f in frames], image.content_hash, key}) == 8  # no collision
    assert req.images == [clip()] * 6 + [png]
    # The prompt is the HF processor's for the same messages with the video as 6 images.
    hf_messages = [{"role": "user", "content": [*[{"type": "image"}] * 6, {"type": "image"},
                                                {"type": "text", "text": "what happens?"}]}]
    dummy = [make_test_image(0, 56, 56)] * 7
    assert req.prompt_token_ids == hf_prompt_ids(llava_dir, hf_messages, dummy)
    spec = MMItemSpec.of(frames[2])
    assert spec.frame is not None and (spec.frame.video, spec.frame.index, spec.frame.count) == (key, 2, 6)
    assert spec.unit == key and spec.video is not None and spec.video.fps == 3
    assert spec.video.min_pixels is None and spec.video.max_pixels is None


async def test_llava_refuses_video_pixel_bounds(llava_dir, backend: ScriptedBackend) -> None:
    body = chat_body([video_part(clip())], mm_processor_kwargs={"max_pixels": 50000})
    async with _llava_client(llava_dir, backend) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "mm_processor_kwargs" and "max_pixels" in error["message"]
    assert not backend.requests


async def test_a_model_without_video_input_refuses_video(qwen2_vl_dir, tmp_path, backend: ScriptedBackend) -> None:
    """A checkpoint with neither a video token nor frames-as-images support (here: Qwen2-VL
    with its video token removed) still answers 400 unsupported_content."""
    import json
    import shutil

    model = tmp_path / "no-video"
    shutil.copytree(qwen2_vl_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    del cfg["video_token_id"]
    (model / "config.json").write_text(json.dumps(cfg))
    config = RouterConfig(model=model, served_model_name="tiny-qwen", max_model_len=512)
    app = create_app(config, backend, processor=MultimodalProcessor.from_pretrained(model))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        resp = await client.post("/v1/chat/completions", json=chat_body([video_part(clip())]))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_content" and "does not accept video" in error["message"]
    assert not backend.requests


async def test_tokenize_counts_video_tokens_as_chat_does(client: httpx.AsyncClient,
                                                         backend: ScriptedBackend) -> None:
    body = chat_body([video_part(clip()), {"type": "text", "text": "hi"}], mm_processor_kwargs={"fps": 7})
    tok = await client.post("/tokenize", json={"messages": body["messages"],
                                               "mm_processor_kwargs": {"fps": 7}})
    assert tok.status_code == 200, tok.text
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert tok.json()["tokens"] == backend.requests[0].prompt_token_ids and tok.json()["count"] > 56
