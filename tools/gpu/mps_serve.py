"""The shared-GPU layout (operator/shared_gpu.py) for real, on one GPU: an EP worker and a D
worker as two processes under NVIDIA MPS, their token ids against a CPU EPD worker's, and the
same `bench serve` load with and without MPS.

    python3 tools/gpu/mps_serve.py             # on the GPU machine (tools/gpu/mps.sh)
    python tools/gpu/mps_serve.py --cpu-only   # the same flow on the CPU, no MPS (a dry run)
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from triptych.local import LocalDeployment
from triptych.tiny_model import tiny_model_path
from triptych.topology import parse_topology

OUT = Path(os.environ.get("OUT", "/tmp"))
GPU = "--cpu-only" not in sys.argv
MODEL = tiny_model_path("qwen2-vl", "small")
MPS_DIRS = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/mps-log"}


def image(w: int, h: int, seed: int) -> dict:
    px = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


REQUESTS = [
    [{"type": "text", "text": "Tell me a story about a lighthouse."}],
    [image(224, 168, 1), {"type": "text", "text": "Describe this picture."}],
    [image(112, 112, 2), image(140, 196, 3), {"type": "text", "text": "Compare the two images."}],
]


def tokens(url: str) -> list[list[str]]:
    """24 greedy tokens (ignore_eos) per request, as the logprobs name them."""
    out = []
    with httpx.Client(timeout=120) as c:
        name = c.get(f"{url}/v1/models").json()["data"][0]["id"]
        for content in REQUESTS:
            r = c.post(f"{url}/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": content}], "max_tokens": 24,
                "temperature": 0, "ignore_eos": True, "logprobs": True})
            r.raise_for_status()
            out.append([t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]])
    return out


def bench(dep: LocalDeployment, tag: str) -> None:
    cmd = [sys.executable, "-m", "triptych.cli", "bench", "serve", "--url", dep.router_url, "--rates", "8", "32",
           "--num-requests", os.environ.get("BENCH_N", "96"), "--output-len", "64", "--images-per-request", "1",
           "--out-json", str(OUT / f"bench_{tag}.json"), "--worker-urls", *[w.url for w in dep.workers]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(p.stdout[-3000:], p.stderr[-1500:], flush=True)


def sh(cmd: str) -> None:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30)
    print(f"$ {cmd}\n{p.stdout}{p.stderr}", flush=True)


def deployment(topology: str, device: str, tag: str) -> LocalDeployment:
    log_dir = OUT / "logs" / tag
    log_dir.mkdir(parents=True, exist_ok=True)
    return LocalDeployment(model=MODEL, topology=parse_topology(topology), log_dir=log_dir,
                           worker_args=["--device", device], transfer_require="nixl" if GPU else "any")


def serve_two(tag: str, want: list[list[str]]) -> None:
    t0 = time.monotonic()
    with deployment("1EP1D", "cuda" if GPU else "cpu", tag) as dep:
        print(f"{tag}: 1EP1D ready in {time.monotonic() - t0:.0f} s")
        got = tokens(dep.router_url)
        if GPU:
            sh("echo get_server_list | nvidia-cuda-mps-control")
            sh("nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; nvidia-smi | tail -7")
        print(f"{tag}: token ids equal to the CPU EPD worker's:", [a == b for a, b in zip(want, got, strict=True)])
        stats = httpx.get(f"{dep.workers[1].url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        print(f"{tag}: D worker", json.dumps({k: stats[k] for k in ("role", "transport", "transfer_bytes")}))
        bench(dep, tag)


def main() -> None:
    t0 = time.monotonic()
    with deployment("EPD", "cpu", "cpu-epd") as ref:
        want = tokens(ref.router_url)
    print(f"CPU EPD reference in {time.monotonic() - t0:.0f} s")
    if not GPU:
        serve_two("cpu", want)
        return
    for d in MPS_DIRS.values():
        os.makedirs(d, exist_ok=True)
    os.environ.update(MPS_DIRS)  # the workers inherit them, as the pod's containers do
    sh("nvidia-cuda-mps-control -d")
    try:
        serve_two("mps", want)
    finally:
        sh("echo quit | nvidia-cuda-mps-control")
    time.sleep(1)
    for k in MPS_DIRS:
        os.environ.pop(k)
    serve_two("no-mps", want)


if __name__ == "__main__":
    main()
