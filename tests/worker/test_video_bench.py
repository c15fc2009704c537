"""`triptych bench video` runs end to end on a tiny clip (figures are not asserted: timing
belongs to the bench, not to tests) and every row returns the same frames (the V-instance
row: the same patches, through two real `worker --role V` processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from triptych.cli import main
from worker.video.synthetic import make_clip


def test_bench_video_cli_on_a_tiny_clip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(make_clip(90, width=64, height=48, fps=30, gop=15))
    assert main(["bench", "video", "--clip", str(clip), "--decoders", "1", "2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["clip"]["frames"] == 90 and report["clip"]["gops"] == 6 and report["sampled_frames"] == 6
    names = [row["decoders"] for row in report["rows"]]
    assert names[0] == "sequential PyAV, 1 thread" and names[-4:] == [
        "collaborative, 1 decoder thread(s)", "collaborative, 2 decoder thread(s)",
        "to patches: sequential PyAV + patchify, 1 thread", "to patches: 2 V instances x 1 thread(s), NIXL pull"]
    # Every row's output equals its baseline's: frames, and the V instances' pulled patches.
    assert all(row["frames_identical"] and row["wall_s"] > 0 for row in report["rows"])
    assert all(row["critical_cpu_s"] > 0 for row in report["rows"] if row["decoders"].startswith("collab"))


def test_bench_clip_is_generated_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.video import bench

    monkeypatch.setenv("TRIPTYCH_VIDEO_CACHE", str(tmp_path))
    first = bench.bench_clip(96, 64, 1, 10, 5)
    mtime = first.stat().st_mtime_ns
    assert bench.bench_clip(96, 64, 1, 10, 5) == first and first.stat().st_mtime_ns == mtime
    index = bench.index_video(first.read_bytes())
    assert (index.width, index.height, index.total_num_frames, len(index.gops)) == (96, 64, 10, 2)
