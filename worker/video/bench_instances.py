"""`triptych bench video`'s V-instance rows: the real serving path, timed end to end.

N V instances (`triptych worker --role V`, separate processes, `--decode-threads t` each)
are started on loopback; each repeat runs what the router and the encode instance do for
one video: the router's `VideoDispatcher` plans the GOP sets (demux, paper 000 Alg. 1),
uploads the bytes to every V instance and hands the sets out stall-free over N x t slots
(Alg. 2); each V instance decodes and patchifies its sets into its registered buffer; an
encode-side `VideoPuller` pulls the parts over the transfer engine (NIXL) and
concatenates them. The output is the video's pixel patches (what the vision tower takes),
so the baseline row is the same work in one process: a 1-thread sequential PyAV decode
of the sampled frames, then `preprocess_frames`. Both rows' patches are compared bit for bit.

The V instances read only the processor config of `--model` (default: the tiny Qwen2-VL
checkpoint, built offline once), whose pixel bounds decide the patch count.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from triptych.http_ready import answers_ok
from triptych.listen_socket import reserve

TIMEOUT_S = 120.0


@contextmanager
def v_instances(model: Path, n: int, threads: int) -> Iterator[list[str]]:
    """N V instance processes on loopback (no auth: a local benchmark), stopped on exit."""
    procs, urls = [], []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRIPTYCH_THREADS": "1"}
    try:
        for i in range(n):
            # Bound here and inherited (listen_socket.py): a probed port number could be taken
            # while the instance loads, and it then exited with 3 (a CI failure, 2026-12-03).
            with reserve("127.0.0.1") as sock:
                port = sock.getsockname()[1]
                cmd = [sys.executable, "-m", "triptych.cli", "worker", "--role", "V", "--model", str(model),
                       "--port", str(port), "--fd", str(sock.fileno()), "--instance-id", f"V-bench-{i}",
                       "--decode-threads", str(threads), "--insecure-no-auth"]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True, pass_fds=(sock.fileno(),)))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + TIMEOUT_S
        for url, proc in zip(urls, procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"V instance {url} exited with {proc.returncode}")
                if answers_ok(f"{url}/ready", timeout_s=1):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"V instance {url} not ready in {TIMEOUT_S:g}s")
                time.sleep(0.2)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """NIXL logs to stdout (its handler takes `sys.stdout` when nixl is first imported);
    `--json` owns stdout: both the file descriptor and the Python object go to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def baseline_patches(data: bytes, model: Path, sampling: dict[str, Any]) -> np.ndarray:
    """One process, one thread: sequential decode of the sampled frames, then patchify."""
    from triptych.video_processing import VideoProcessorConfig, preprocess_frames

    from .bench import sequential_sampled_frames
    from .sampling import SamplingOptions

    cfg = VideoProcessorConfig.from_pretrained(model)
    options = SamplingOptions.from_request(sampling, cfg.sampling_defaults())
    return preprocess_frames(np.stack(sequential_sampled_frames(data, options, 1)), cfg).pixel_values_videos


def time_v_instances(data: bytes, model: Path, sampling: dict[str, Any], urls: list[str], threads: int,
                     repeats: int) -> tuple[list[float], np.ndarray]:
    """Wall seconds per repeat from the bytes to the pulled patches, and the last patches."""
    from triptych.router.registry import Instance
    from triptych.router.video_decode import VideoDispatcher
    from triptych.stage_protocol import MMItemSpec, VideoOptions
    from triptych.topology import InstanceType
    from triptych.video_processing import VideoProcessorConfig
    from triptych.worker.transfer import TransferEngine
    from triptych.worker.video_pull import VideoPuller

    cfg = VideoProcessorConfig.from_pretrained(model)
    patch_dim = 3 * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size
    item = MMItemSpec(kind="video", offset=0, length=1, content_hash="bench", video=VideoOptions(**sampling))
    instances = [Instance(url=u, role=InstanceType.V, ready=True) for u in urls]
    puller = VideoPuller(512 << 20)

    async def once(transfer: TransferEngine, i: int) -> np.ndarray:
        async with httpx.AsyncClient(trust_env=False) as client:
            dispatcher = VideoDispatcher(client, str(model), slots_per_instance=threads, timeout_s=TIMEOUT_S)
            parts = await dispatcher.decode(f"bench-{i}", data, item, instances)
        rows, _grid = await asyncio.to_thread(puller.pull, transfer, parts, patch_dim, TIMEOUT_S)
        return rows

    walls, rows = [], np.empty(0)
    with _stdout_to_stderr(), TransferEngine("bench-e") as transfer:
        for i in range(repeats + 1):  # the first run warms the V instances' upload store and NIXL peers
            started = time.perf_counter()
            rows = asyncio.run(once(transfer, i))
            if i:
                walls.append(time.perf_counter() - started)
    return walls, rows
