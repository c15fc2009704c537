"""`triptych bench video`: time to the sampled frames of one video, sequential vs collaborative.

The clip (720p, 60 s, H.264, 2 s GOPs with B-frames by default) is generated once with
PyAV and cached under ~/.cache/triptych/video. Each row is the wall time from the video's
bytes to the sampled frames as RGB arrays (per frame or per segment, not stacked into one
array) at `--sample-fps` (transformers' Qwen2-VL
sampling):

- sequential PyAV, 1 thread: decode every frame front to back, keep the sampled ones
  (what transformers' PyAV reader and most servers do);
- sequential PyAV, FFmpeg's own frame threads (a reference: FFmpeg's intra-decoder
  parallelism on the same cores);
- collaborative, k single-threaded decoders (paper 000 §3.2-3.3): demux index, GOP-aligned
  segments, stall-free scheduling over k threads.

Speedup is against the 1-thread sequential row; efficiency = speedup / min(k, cores), the
goal being >= 0.9. Decoding is CPU-bound, so wall figures on a shared machine depend on
its load (printed with the table). The CPU columns separate the decomposition from the
contention: `crit. cpu s` is the CPU time of the critical path (the main thread's
demux/plan/assembly plus the busiest decoder thread), i.e. the wall time each decoder
would take on a free core; `cpu speedup` = sequential CPU s / critical-path CPU s.

The V-instance rows (bench_instances.py) time the serving path instead: N `worker --role V`
processes decode and patchify the GOP sets the router's dispatcher hands them, and an
encode-side puller pulls the patches over NIXL; their baseline is a 1-thread sequential
decode + patchify in one process (same patches, compared bit for bit).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .collaborative import CollaborativeDecoder, DecoderSlot, LocalSlot
from .demux import index_video
from .sampling import SamplingOptions, sample_frame_indices

TEMPORAL_PATCH_SIZE = 2  # Qwen2-VL / Qwen2.5-VL


def cache_dir() -> Path:
    return Path(os.environ.get("TRIPTYCH_VIDEO_CACHE", Path.home() / ".cache" / "triptych" / "video"))


def bench_clip(width: int, height: int, seconds: int, fps: int, gop: int, preset: str = "veryfast") -> Path:
    """The benchmark clip, encoded once: a textured scene panning and drifting in colour (so
    motion compensation works as on camera footage), H.264 yuv420p, B-frames, fixed GOP."""
    path = cache_dir() / f"bench-{width}x{height}-{seconds}s-{fps}fps-gop{gop}-{preset}.mp4"
    if path.is_file():
        return path
    import av
    from PIL import Image

    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 256, size=(-(-height // 24), -(-(width + seconds * fps * 4) // 24), 3), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(coarse).resize((coarse.shape[1] * 24, coarse.shape[0] * 24),
                                                        Image.Resampling.BICUBIC))
    grain = rng.integers(-6, 7, size=(height, width, 3), dtype=np.int16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": preset, "crf": "23",
                          "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=2"}
        for i in range(seconds * fps):
            frame = texture[:height, i * 4:i * 4 + width].astype(np.int16) + grain + (i % 64)
            video_frame = av.VideoFrame.from_ndarray(np.clip(frame, 0, 255).astype(np.uint8), format="rgb24")
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.rename(path)
    return path


def sequential_sampled_frames(data: bytes, options: SamplingOptions, threads: int) -> list[np.ndarray]:
    """The baseline: one decoder front to back, sampled frames kept (transformers' PyAV reader).
    Frames come back as a list (no final stacking copy), as the collaborative decoder's
    come back per segment."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = threads
        if threads != 1:
            stream.codec_context.thread_type = "AUTO"
        fps = float(stream.average_rate)
        wanted = set(sample_frame_indices(stream.frames, fps, TEMPORAL_PATCH_SIZE, options))
        return [frame.to_ndarray(format="rgb24") for i, frame in enumerate(container.decode(stream)) if i in wanted]


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """Median wall seconds and median process CPU seconds over `repeats` runs, and the result."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
    return statistics.median(walls), statistics.median(cpus), result


class _CpuTimedSlot:
    """A slot that adds up the CPU seconds its own thread spends (time.thread_time)."""

    def __init__(self, inner: DecoderSlot) -> None:
        self.inner, self.cpu_s = inner, 0.0

    def run(self, data: bytes, segment: Any) -> Any:
        start = time.thread_time()
        try:
            return self.inner.run(data, segment)
        finally:
            self.cpu_s += time.thread_time() - start


def _collaborative_row(data: bytes, options: SamplingOptions, slots: list[DecoderSlot] | None,
                       k: int, repeats: int) -> tuple[float, float, float, np.ndarray]:
    """Median wall and process CPU seconds, the median critical-path CPU seconds (the main
    thread's demux/plan/assembly plus the busiest decoder's CPU time: the wall time with a
    free core per decoder), and the frames."""
    timed = [_CpuTimedSlot(slot) for slot in (slots or [LocalSlot() for _ in range(k)])]
    critical: list[float] = []

    def once() -> np.ndarray:
        for slot in timed:
            slot.cpu_s = 0.0
        main0 = time.thread_time()
        video = pool.decode(data, TEMPORAL_PATCH_SIZE, options, timeout=600)
        critical.append(time.thread_time() - main0 + max(slot.cpu_s for slot in timed))
        return video

    with CollaborativeDecoder(slots=timed) as pool:
        wall, cpu, video = _time(once, repeats)
    return wall, cpu, statistics.median(critical), video.frames()  # stacked after timing


def run(args: argparse.Namespace) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    clip = Path(args.clip) if args.clip else bench_clip(args.width, args.height, args.seconds, args.fps, args.gop)
    data = clip.read_bytes()
    index = index_video(data)
    options = SamplingOptions(fps=args.sample_fps, max_frames=args.max_frames)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    base_wall, base_cpu, reference = _time(lambda: sequential_sampled_frames(data, options, 1), args.repeats)
    reference = np.stack(reference)
    base = (base_wall, base_cpu)
    rows.append(_row("sequential PyAV, 1 thread", 1, base_wall, base_cpu, base_cpu, base, cores))
    wall, cpu, frames = _time(lambda: sequential_sampled_frames(data, options, 0), args.repeats)
    rows.append(_row("sequential PyAV, FFmpeg frame threads", cores, wall, cpu, None, base, cores,
                     identical=bool(np.array_equal(np.stack(frames), reference))))
    for k in sorted(set(args.decoders or [1, 2, cores])):
        wall, cpu, critical, frames = _collaborative_row(data, options, None, k, args.repeats)
        rows.append(_row(f"collaborative, {k} decoder thread(s)", k, wall, cpu, critical, base, cores,
                         identical=bool(np.array_equal(frames, reference))))
    rows += _v_rows(data, args, cores)
    return {
        "clip": {"path": str(clip), "bytes": len(data), "codec": index.codec, "size": f"{index.width}x{index.height}",
                 "frames": index.total_num_frames, "fps": index.fps, "gops": len(index.gops)},
        "sample_fps": args.sample_fps, "sampled_frames": len(reference), "cores": cores,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "repeats": args.repeats, "rows": rows,
    }


def _v_rows(data: bytes, args: argparse.Namespace, cores: int) -> list[dict[str, Any]]:
    """The serving path to pixel patches: 1-thread decode + patchify vs N V instances."""
    n, threads = getattr(args, "v_instances", 0), getattr(args, "v_threads", 1)
    if not n:
        return []
    from .bench_instances import baseline_patches, time_v_instances, v_instances

    if getattr(args, "model", None):
        model = Path(args.model)
    else:
        from triptych.tiny_model import tiny_model_path

        model = tiny_model_path("qwen2-vl")
    sampling = {"fps": args.sample_fps, "max_frames": args.max_frames}
    base_wall, base_cpu, reference = _time(lambda: baseline_patches(data, model, sampling), args.repeats)
    base = (base_wall, base_cpu)
    rows = [_row("to patches: sequential PyAV + patchify, 1 thread", 1, base_wall, base_cpu, None, base, cores)]
    with v_instances(model, n, threads) as urls:
        walls, patches = time_v_instances(data, model, sampling, urls, threads, args.repeats)
    row = _row(f"to patches: {n} V instances x {threads} thread(s), NIXL pull", n * threads,
               statistics.median(walls), 0.0, None, base, cores, identical=bool(np.array_equal(patches, reference)))
    row["cpu_s"] = None  # the work runs in the V processes: this process's CPU time says nothing
    return [*rows, row]


def _row(name: str, k: int, wall: float, cpu: float, critical: float | None, base: tuple[float, float],
         cores: int, identical: bool = True) -> dict[str, Any]:
    """Wall speedup/efficiency against the 1-thread sequential row; on a shared machine also
    the critical-path CPU speedup (sequential CPU s / critical-path CPU s): what the wall
    speedup would be with a free core per decoder."""
    speedup = base[0] / wall
    row = {"decoders": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "speedup": round(speedup, 2),
           "efficiency": round(speedup / min(k, cores), 2), "critical_cpu_s": None, "cpu_speedup": None,
           "frames_identical": identical}
    if critical is not None:
        row["critical_cpu_s"] = round(critical, 3)
        row["cpu_speedup"] = round(base[1] / critical, 2)
    return row


def print_table(report: dict[str, Any]) -> None:
    clip = report["clip"]
    print(f"clip: {clip['size']} {clip['codec']}, {clip['frames']} frames at {clip['fps']:g} fps, "
          f"{clip['gops']} GOPs, {clip['bytes'] / 1e6:.1f} MB; sampled {report['sampled_frames']} frames "
          f"at {report['sample_fps']:g} fps; {report['cores']} cores; median of {report['repeats']}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in report['loadavg_before'])}, "
          f"after: {' '.join(f'{x:.2f}' for x in report['loadavg_after'])}")
    print(f"{'decoders':52} {'wall s':>7} {'speedup':>7} {'eff.':>5} {'cpu s':>7} {'crit. cpu s':>11} "
          f"{'cpu speedup':>11}  same frames")
    for row in report["rows"]:
        crit = f"{row['critical_cpu_s']:11.3f} {row['cpu_speedup']:11.2f}" if row["critical_cpu_s"] else f"{'-':>11} {'-':>11}"
        cpu = f"{row['cpu_s']:7.3f}" if row["cpu_s"] is not None else f"{'-':>7}"
        print(f"{row['decoders']:52} {row['wall_s']:7.3f} {row['speedup']:7.2f} {row['efficiency']:5.2f} "
              f"{cpu} {crit}  {'yes' if row['frames_identical'] else 'NO'}")


def cli_main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print_table(report)
    return 0 if all(row["frames_identical"] for row in report["rows"]) else 1

