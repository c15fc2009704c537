"""Frame sampling equals transformers' Qwen2-VL `sample_frames` (run from its own source).

transformers' video processor module imports torchvision, which cannot be installed here,
so the test lifts the body of `Qwen2VLVideoProcessor.sample_frames` out of the installed
file with `ast` and runs it with torch: the reference is transformers' own code, and the
test fails if a later transformers changes the arithmetic.
"""

from __future__ import annotations

import ast
import itertools
import math
import types
from pathlib import Path

import pytest
import torch
import transformers
from pydantic import ValidationError

from worker.video.errors import EmptyVideoError, VideoError
from worker.video.sampling import SamplingOptions, sample_frame_indices, second_per_grid_t

SOURCE = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"


def _hf_sample_frames():
    tree = ast.parse(SOURCE.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    namespace = {"math": math, "torch": torch, "VideoMetadata": object}
    exec(compile(ast.Module([fn], []), str(SOURCE), "exec"), namespace)
    return namespace["sample_frames"]


HF_SAMPLE = _hf_sample_frames()
DEFAULTS = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)


def _hf(total: int, video_fps: float, **kwargs) -> list[int]:
    metadata = types.SimpleNamespace(total_num_frames=total, fps=video_fps)
    indices = HF_SAMPLE(DEFAULTS, metadata, **kwargs).tolist()
    # transformers' float arange can add one index == total (past the last frame; no decoder
    # returns it): sampling.py documents dropping it.
    return [i for i in indices if i < total]


@pytest.mark.parametrize("temporal", [1, 2])
def test_fps_sampling_equals_transformers(temporal: int) -> None:
    checked = 0
    for total, video_fps, fps, max_frames in itertools.product(
            [2, 3, 5, 7, 31, 61, 97, 250, 1799, 1800, 3001, 12345],
            [23.976, 24, 25, 29.97, 30, 59.94, 60], [0.5, 1, 2, 3.3, 6], [8, 16, 64, 768]):
        ours = sample_frame_indices(total, video_fps, temporal,
                                    SamplingOptions(fps=fps, max_frames=max_frames, min_frames=4))
        ref = _hf(total, video_fps, fps=fps, max_frames=max_frames, temporal_patch_size=temporal)
        assert ours == ref, (total, video_fps, fps, max_frames)
        assert len(ours) % temporal == 0 and len(ours) <= max_frames
        checked += 1
    assert checked == 12 * 7 * 5 * 4


def test_num_frames_sampling_equals_transformers() -> None:
    for total, num in [(100, 8), (100, 7), (61, 14), (10, 10)]:
        ours = sample_frame_indices(total, 30.0, 2, SamplingOptions(num_frames=num))
        assert ours == _hf(total, 30.0, num_frames=num)


def test_the_arange_quirk_is_the_reason_for_dropping_an_index() -> None:
    # 61 frames at 24 fps sampled at 6 fps: 14 frames, but transformers' arange gives 15
    # indices, the last one 61 (outside the video).
    metadata = types.SimpleNamespace(total_num_frames=61, fps=24)
    raw = HF_SAMPLE(DEFAULTS, metadata, fps=6).tolist()
    assert len(raw) == 15 and raw[-1] == 61
    assert sample_frame_indices(61, 24, 2, SamplingOptions(fps=6)) == raw[:14]


def test_defaults_are_two_fps_like_qwen_tooling() -> None:
    # 10 s at 30 fps -> 20 frames, evenly spread.
    assert sample_frame_indices(300, 30.0, 2) == list(range(0, 300, 15))
    assert SamplingOptions().effective_fps == 2.0
    assert SamplingOptions(num_frames=8).effective_fps is None


def test_shorter_than_one_temporal_patch_takes_every_frame() -> None:
    # transformers divides by zero here; we take the one frame (patchify repeats it).
    with pytest.raises(ZeroDivisionError):
        HF_SAMPLE(DEFAULTS, types.SimpleNamespace(total_num_frames=1, fps=30.0), fps=2.0)
    assert sample_frame_indices(1, 30.0, 2) == [0]


def test_bad_sampling_options() -> None:
    with pytest.raises(ValidationError):
        SamplingOptions(fps=2.0, num_frames=8)
    with pytest.raises(ValidationError):
        SamplingOptions(min_frames=10, max_frames=4)
    with pytest.raises(ValidationError):
        SamplingOptions(fps=0)
    with pytest.raises(EmptyVideoError):
        sample_frame_indices(0, 30.0, 2)
    with pytest.raises(VideoError):
        sample_frame_indices(10, 30.0, 2, SamplingOptions(num_frames=20))


def test_second_per_grid_t_is_qwen25_processor_rule() -> None:
    # Qwen2_5_VLProcessor: temporal_patch_size / VideoMetadata.sampled_fps.
    assert second_per_grid_t(20, 300, 30.0, 2) == pytest.approx(1.0)
    assert second_per_grid_t(8, 100, 25.0, 2) == pytest.approx(2 / (8 / 100 * 25.0))


def test_request_options_over_checkpoint_defaults() -> None:
    defaults = {"fps": 1.0, "min_frames": 4, "max_frames": 64}
    assert SamplingOptions.from_request(None, defaults) == SamplingOptions(fps=1.0, min_frames=4, max_frames=64)
    assert SamplingOptions.from_request({"fps": 4}, defaults).fps == 4
    by_count = SamplingOptions.from_request({"num_frames": 8}, defaults)
    assert (by_count.num_frames, by_count.fps, by_count.max_frames) == (8, None, 64)
    for bad in ({"fps": 2, "num_frames": 8}, {"fps": -1}, {"max_frames": 0}, {"frames_per_second": 2}):
        with pytest.raises(ValidationError):
            SamplingOptions.from_request(bad, defaults)
