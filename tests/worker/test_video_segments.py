"""GOP-aligned segment planning: cuts at GOPs, temporal-patch alignment by taking more
frames (paper 000 Fig. 7b), balance, and the plan as a serialisable work unit."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from worker.video.demux import Gop, VideoIndex
from worker.video.segments import Segment, plan_segments


def _index(gop_sizes: list[int], codec: str = "h264") -> VideoIndex:
    gops, start = [], 0
    for i, size in enumerate(gop_sizes):
        gops.append(Gop(i, start, size, keyframe_pts=start * 512, byte_offset=1000 + start))
        start += size
    return VideoIndex(codec, 64, 48, 24.0, Fraction(1, 12288), tuple(i * 512 for i in range(start)),
                      tuple(gops), 12345)


def test_fig7b_takes_more_frames_never_fewer() -> None:
    index = _index([10, 10])
    segments = plan_segments(index, list(range(20)), temporal_patch_size=4, num_segments=2)
    # Cut at the GOP boundary (10 frames) is not a multiple of 4: segment 0 takes the next
    # two frames of GOP 1 (12 frames) instead of giving two back (8 frames).
    assert [s.frame_indices for s in segments] == [list(range(12)), list(range(12, 20))]
    assert [t.gop for t in segments[0].gops] == [0, 1] and segments[1].gops[0].gop == 1
    # Segment 1 starts mid-GOP: it still decodes from GOP 1's keyframe.
    assert segments[1].gops[0].keyframe_pts == 10 * 512 and segments[1].decode_cost == 10


def test_random_plans_keep_order_alignment_and_gop_cuts() -> None:
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.randint(1, 30) for _ in range(rng.randint(1, 12))]
        index = _index(sizes)
        total = index.total_num_frames
        frames = sorted(rng.sample(range(total), rng.randint(1, total)))
        tps, parts = rng.choice([1, 2, 4]), rng.randint(1, 8)
        segments = plan_segments(index, frames, tps, parts)
        assert [f for s in segments for f in s.frame_indices] == frames
        assert len(segments) <= parts and [s.index for s in segments] == list(range(len(segments)))
        for seg in segments[:-1]:
            assert len(seg.frame_indices) % tps == 0
        for seg in segments:
            for task in seg.gops:  # each GOP task holds only frames of its GOP
                gop = index.gops[task.gop]
                assert all(gop.first_frame <= f < gop.first_frame + gop.num_frames for f in task.frame_indices)
                assert task.frame_pts == [index.frame_pts[f] for f in task.frame_indices]
        # A segment starts mid-GOP only after alignment took the GOP's first frames: fewer than tps.
        for prev, seg in zip(segments, segments[1:], strict=False):
            shared = set(t.gop for t in prev.gops) & {seg.gops[0].gop}
            if shared:
                taken = [f for t in prev.gops if t.gop == seg.gops[0].gop for f in t.frame_indices]
                assert 0 < len(taken) < tps


def test_balance_splits_equal_gops_evenly() -> None:
    index = _index([30] * 8)
    segments = plan_segments(index, list(range(0, 240, 5)), temporal_patch_size=2, num_segments=4)
    assert [len(s.gops) for s in segments] == [2, 2, 2, 2]
    assert len({s.decode_cost for s in segments}) == 1


def test_fewer_gops_than_segments_and_single_gop() -> None:
    assert len(plan_segments(_index([100]), [0, 50, 99], 2, 8)) == 1
    assert len(plan_segments(_index([10, 10, 10]), list(range(30)), 2, 8)) == 3


def test_seek_rule_follows_codec_and_plan_serialises() -> None:
    h264 = plan_segments(_index([8, 8], "h264"), list(range(16)), 2, 2)
    vp9 = plan_segments(_index([8, 8], "vp9"), list(range(16)), 2, 2)
    assert [s.seek_per_gop for s in h264] == [False, False] and [s.seek_per_gop for s in vp9] == [True, True]
    wire = h264[1].model_dump_json()
    assert Segment.model_validate_json(wire) == h264[1]


def test_bad_frame_lists() -> None:
    index = _index([8, 8])
    for frames in ([], [3, 1], [1, 1], [16]):
        with pytest.raises(ValueError):
            plan_segments(index, frames, 2, 2)


def test_video_modules_import_without_torch_or_pyav() -> None:
    # The router may count video tokens with these: they must not load torch (nor PyAV
    # before a video is opened).
    import subprocess
    import sys

    code = ("import sys, triptych.worker.video, triptych.video_processing; "
            "print(sorted(m for m in ('torch', 'av', 'PyNvVideoCodec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
