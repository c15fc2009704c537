"""An encode instance decodes images on its decode pool (worker/admission.py), not on its
event loop: `/health` keeps answering fast while it decodes 8 large images. And the
worker re-hashes image bytes: bytes sent under another image's hash are refused."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from triptych.local import LocalDeployment
from triptych.processor import MultimodalProcessor
from triptych.stage_protocol import STAGE_FRAME_TYPE, MMItemSpec, StageRequest, encode_stage_request
from triptych.tiny_model import tiny_model_path
from triptych.topology import InstanceType

pytestmark = pytest.mark.timeout(600)


def big_png(seed: int, side: int = 4096) -> bytes:
    """A side x side PNG of blocky noise: every pixel must be decoded and resized, but the
    file stays ~1.5 MB (pure noise would make a 50 MB body that takes seconds to parse)."""
    small = np.random.default_rng(seed).integers(0, 255, (512, 512, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((side, side), Image.NEAREST).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_model_path("qwen2-vl")
    dep = LocalDeployment(model=model, topology={InstanceType.E: 1}, log_dir=tmp_path_factory.mktemp("logs"))
    worker = dep.start_worker(InstanceType.E, 0)
    dep.processes.append(worker)
    try:
        dep.wait_ready([worker])
        yield model, dep, worker
    finally:
        dep.stop()


def encode_request(model: Path, images: list[bytes], request_id: str) -> StageRequest:
    proc = MultimodalProcessor.from_pretrained(model)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "describe"}]
    prompt = proc.process([{"role": "user", "content": content}], images)
    return StageRequest(request_id=request_id, stages=["encode"], prompt_token_ids=prompt.token_ids,
                        mm_items=[MMItemSpec.of(it) for it in prompt.mm_items],
                        images={it.content_hash: img for it, img in zip(prompt.mm_items, images, strict=True)})


def post_frame(url: str, sreq: StageRequest, headers: dict[str, str]) -> httpx.Response:
    """One stage request as the router sends it: the binary frame (stage_protocol)."""
    return httpx.post(f"{url}/internal/run", content=encode_stage_request(sreq), timeout=60,
                      headers={**headers, "content-type": STAGE_FRAME_TYPE})


def test_health_stays_fast_while_decoding_8_large_images(encoder) -> None:
    model, dep, worker = encoder
    sreq = encode_request(model, [big_png(seed) for seed in range(8)], "big-8")
    result: dict = {}

    def run() -> None:
        with httpx.stream("POST", f"{worker.url}/internal/run", content=encode_stage_request(sreq), timeout=300,
                          headers={**dep.internal_headers, "content-type": STAGE_FRAME_TYPE}) as r:
            result["status"] = r.status_code
            result["lines"] = [line for line in r.iter_lines() if line.strip()]

    latencies: list[float] = []
    thread = threading.Thread(target=run)
    with httpx.Client(timeout=10) as client:
        idle = []
        for _ in range(50):  # the same probe with nothing to decode, for the failure message
            t0 = time.monotonic()
            client.get(f"{worker.url}/health")
            idle.append(time.monotonic() - t0)
            time.sleep(0.02)
        thread.start()
        started = time.monotonic()
        while thread.is_alive():
            t0 = time.monotonic()
            assert client.get(f"{worker.url}/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    thread.join()
    elapsed = time.monotonic() - started
    assert result["status"] == 200 and '"encoded"' in result["lines"][-1], result
    # 100 ms, plus the machine's own noise: the worst idle probe just before (a few ms on a
    # quiet machine; on a shared, overloaded one an idle probe alone can take 200 ms).
    # Decoding on the event loop stalls it for whole image decodes (~0.3 s each, 8 in a row).
    # One probe may still be caught by a hiccup of the shared machine itself (CI saw a single
    # 140 ms probe among 122 of ~5 ms); decoding on the loop stalls every probe it overlaps,
    # so the second-worst probe is what must stay inside the budget.
    budget = 0.1 + max(idle)
    second_worst = sorted(latencies)[-2]
    print(f"\n/health while decoding 8 large images: max {max(latencies) * 1000:.1f} ms, second {second_worst * 1000:.1f} ms "
          f"over {len(latencies)} probes; idle max {max(idle) * 1000:.1f} ms")
    assert second_worst < budget, (f"second-worst /health {second_worst * 1000:.0f} ms over {len(latencies)} probes "
                                   f"in {elapsed:.1f}s; idle max {max(idle) * 1000:.0f} ms", sorted(latencies)[-5:])
    assert elapsed > 1.0 and len(latencies) >= 20, (elapsed, len(latencies))  # it did decode meanwhile


def test_image_under_another_hash_is_refused(encoder) -> None:
    model, dep, worker = encoder
    real, other = big_png(1, 64), big_png(2, 64)
    sreq = encode_request(model, [real], "poison")
    (h,) = sreq.images
    sreq.images[h] = other  # other bytes under real's hash
    assert hashlib.sha256(other).hexdigest() != h
    r = post_frame(worker.url, sreq, dep.internal_headers)
    assert r.status_code == 400 and "hashes to" in r.json()["error"]["message"], r.text
    sreq = encode_request(model, [real], "honest")  # the right bytes still encode
    r = post_frame(worker.url, sreq, dep.internal_headers)
    assert r.status_code == 200 and '"encoded"' in r.text, r.text


def test_image_bytes_cross_raw_in_the_frame_and_never_as_base64_json(encoder) -> None:
    model, dep, worker = encoder
    png = big_png(3, 64)
    sreq = encode_request(model, [png], "framed")
    frame = encode_stage_request(sreq)
    assert png in frame and base64.b64encode(png) not in frame  # the bytes that cross: raw
    r = post_frame(worker.url, sreq, dep.internal_headers)
    assert r.status_code == 200, r.text
    (encoded,) = [json.loads(line) for line in r.text.splitlines() if '"encoded"' in line]
    assert [it["content_hash"] for it in encoded["items"]] == [hashlib.sha256(png).hexdigest()]
    # The old form, base64 inside the JSON, is refused by name (422), not read as bytes.
    old = json.loads(sreq.model_dump_json()) | {"request_id": "old", "images": {
        sreq.mm_items[0].content_hash: base64.b64encode(png).decode()}}
    r = httpx.post(f"{worker.url}/internal/run", json=old, headers=dep.internal_headers, timeout=60)
    assert r.status_code == 422 and "binary tail" in r.json()["error"]["message"], r.text
    # A frame cut short (its image's bytes missing) is refused, and nothing runs.
    r = httpx.post(f"{worker.url}/internal/run", content=frame[:-10], timeout=60,
                   headers={**dep.internal_headers, "content-type": STAGE_FRAME_TYPE})
    assert r.status_code == 422 and "frame" in r.json()["error"]["message"], r.text
