"""The engine admits video items given as bytes (as a stage request carries them): it
decodes them itself with the collaborative decoder, patchifies them with the options the
router resolved, and its greedy tokens equal transformers' (fp32); a bad video or a
placeholder run that does not match the decoded grid is a typed 400 at admission."""

from __future__ import annotations

import pytest
from polling import wait_until
from videokit import VideoCase, expected_ids

from triptych.processor import MultimodalProcessor
from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import MMItemSpec, VideoOptions
from triptych.tiny_model import tiny_model_path
from triptych.video_processing import VideoProcessorConfig, VideoTokens, expand_videos
from triptych.worker.engine import Engine, EngineConfig, Request
from triptych.worker.engine.request import RequestValidationError
from triptych.worker.engine.video_inputs import VIDEOS_DECODED
from triptych.worker.video import index_video, video_id

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def _request(family: str, case: VideoCase, fps: float, grid_t: int, spgt: float | None) -> Request:
    model_dir = tiny_model_path(family)
    proc = MultimodalProcessor.from_pretrained(model_dir)
    cfg = VideoProcessorConfig.from_pretrained(model_dir)
    index = index_video(case.video)
    images = [case.image] if case.with_image else []
    opts = {"fps": fps, "min_frames": 4, "max_frames": 768, "min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}
    prompt = expand_videos(proc.process(case.hf_messages(), images), proc.tokenizer.token_to_id("<|video_pad|>"),
                           cfg.merge_size, [VideoTokens((grid_t, 4, 8), video_id(case.video), index.width,
                                                        index.height, spgt, options=opts)])
    items = [MMItemSpec.of(m) for m in prompt.mm_items]
    blobs = {video_id(case.video): case.video}
    for item, img in zip([m for m in prompt.mm_items if m.kind == "image"], prompt.images, strict=True):
        blobs[item.content_hash] = img.image
    return Request("v", prompt.token_ids, SamplingParams(temperature=0.0, max_tokens=case.max_tokens),
                   mm_items=items, images=blobs)


@pytest.mark.parametrize("with_image", [False, True])
@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_engine_decodes_video_bytes_like_transformers(family: str, with_image: bool) -> None:
    case = VideoCase(seed=3, fps=7.0, with_image=with_image, stream=False)
    engine = Engine(EngineConfig(model=str(tiny_model_path(family)), max_num_seqs=1))
    before = VIDEOS_DECODED.labels("encoder")._value.get()
    (done,) = engine.generate_batch([_request(family, case, 7.0, 7, 2 / 7 if family == "qwen2.5-vl" else None)])
    assert done.error is None
    assert done.output_token_ids == expected_ids(tiny_model_path(family), case)
    assert VIDEOS_DECODED.labels("encoder")._value.get() == before + 1


def test_bad_video_bytes_and_wrong_runs_are_refused() -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_path("qwen2-vl")), max_num_seqs=1))
    case = VideoCase(seed=3, fps=7.0, with_image=False, stream=False)
    wrong_grid = _request("qwen2-vl", case, 2.0, 7, None)  # 2 fps decodes 4 frames (t=2), run says t=7
    with pytest.raises(RequestValidationError, match="placeholder run"):
        engine.add_request(wrong_grid)
    bad = _request("qwen2-vl", case, 7.0, 7, None)
    bad.images = {video_id(case.video): case.video[: len(case.video) // 2]}
    with pytest.raises(RequestValidationError):
        engine.add_request(bad)
    assert VideoOptions(fps=2.0).sampling() == {"fps": 2.0}
    (ok,) = engine.generate_batch([_request("qwen2-vl", case, 7.0, 7, None)])
    assert ok.error is None and ok.output_token_ids


def test_encoder_decodes_with_a_decoder_service(tmp_path) -> None:
    """GOP sets split between the encoder's own decoder threads and a decoder service (the
    V instance's work): same tokens as transformers, and the service got the video."""
    import threading

    import httpx
    import uvicorn

    from triptych.local import free_port
    from triptych.worker.engine.video_inputs import VideoInputs
    from triptych.worker.video.service import create_decoder_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_decoder_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: server.started, 20, interval_s=0.05), "decoder service did not start"
    try:
        case = VideoCase(seed=3, fps=24.0, with_image=False, stream=False)  # 48 frames: several GOP sets
        engine = Engine(EngineConfig(model=str(tiny_model_path("qwen2-vl")), max_num_seqs=1))
        engine.admission.videos = VideoInputs(str(tiny_model_path("qwen2-vl")), engine.vision, [url])
        before = VIDEOS_DECODED.labels("encoder+v")._value.get()
        (done,) = engine.generate_batch([_request("qwen2-vl", case, 24.0, 24, None)])
        assert done.error is None and done.output_token_ids == expected_ids(tiny_model_path("qwen2-vl"), case)
        remote = engine.admission.videos._pool.slots[0]
        assert remote.url == url and remote.uploads == 1
        assert VIDEOS_DECODED.labels("encoder+v")._value.get() == before + 1
        assert httpx.get(f"{url}/live").status_code == 200
    finally:
        server.should_exit = True
