"""NVDEC vs PyAV on the same GOP-aligned segments of one clip: sampled frames/s, and the pixels compared."""
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from triptych.worker.video.bench import bench_clip
from triptych.worker.video.decode import NvdecBackend, PyAVBackend
from triptych.worker.video.demux import index_video
from triptych.worker.video.sampling import SamplingOptions, sample_frame_indices
from triptych.worker.video.segments import plan_segments

W, H, SECONDS, FPS, GOP = 1280, 720, 20, 30, 60
t = time.monotonic()
data = bench_clip(W, H, SECONDS, FPS, GOP).read_bytes()
print(f"clip {W}x{H} {SECONDS}s {FPS}fps gop{GOP}: {len(data)} bytes, made in {time.monotonic() - t:.1f} s")
index = index_video(data)


def run(backend, segments, threads):
    def one(s):
        out = backend.decode(data, s)
        return out.frames.cpu().numpy() if isinstance(out.frames, torch.Tensor) else out.frames
    start = time.monotonic()
    if threads == 1:
        frames = [one(s) for s in segments]
    else:
        with ThreadPoolExecutor(threads) as pool:
            frames = list(pool.map(one, segments))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.monotonic() - start, np.concatenate(frames)


for fps in (2.0, 30.0):
    frames = sample_frame_indices(index.total_num_frames, index.fps, 2, SamplingOptions(fps=fps))
    print(f"\n== sample fps {fps}: {len(frames)} of {index.total_num_frames} frames")
    ref = None
    for name, make, nseg, threads in (("pyav 1 thread", lambda: PyAVBackend(1), 1, 1),
                                      ("pyav 16 segs x 1 thread", lambda: PyAVBackend(1), 16, 16),
                                      ("nvdec 1 seg", NvdecBackend, 1, 1),
                                      ("nvdec 4 segs x 4 threads", NvdecBackend, 4, 4)):
        try:
            backend = make()
        except Exception as exc:
            print(f"{name}: {exc}")
            continue
        segments = plan_segments(index, frames, 2, nseg, video_id=f"v{nseg}")
        run(backend, segments, threads)  # warm-up (opens decoders, writes NVDEC's file)
        times, out = [], None
        for _ in range(3):
            wall, out = run(backend, segments, threads)
            times.append(wall)
        if ref is None:
            ref = out
        diff = float(np.abs(out.astype(int) - ref.astype(int)).mean())
        med = statistics.median(times)
        print(f"{name:28s} median {med * 1000:8.1f} ms  {len(frames) / med:8.1f} frames/s  "
              f"shape {tuple(out.shape)}  mean |diff| vs pyav {diff:.3f}")
        sys.stdout.flush()
