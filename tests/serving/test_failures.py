"""Failures through real processes (router + workers, NIXL, `--transfer-require nixl`):
an E or a P instance SIGKILLed while requests are on their way to it (the router retries on the
survivors; completions stay exact; no survivor leaks a block; the restarted worker serves
again), and the bad-input corpus against a live deployment: every case a 400 in OpenAI's
error shape, and the deployment still answers a good request afterwards.

(A decode instance killed mid-stream is covered in test_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import servekit
from hf_reference import make_test_image, png_bytes
from servekit import tiny_dir

from triptych.local import LocalDeployment, Process

pytestmark = pytest.mark.slow

LEASE_S = 3  # a lease handed to a dead target frees at its TTL: keep the wait short


def _deployment(topology: str, tmp: Path) -> Iterator[tuple[Path, LocalDeployment]]:
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, topology, tmp, worker_args=["--lease-seconds", str(LEASE_S)]) as dep:
        yield model, dep


@pytest.fixture(scope="module")
def two_encoders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalDeployment]]:
    yield from _deployment("2E1P1D", tmp_path_factory.mktemp("2E1P1D"))


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalDeployment]]:
    yield from _deployment("1E2P1D", tmp_path_factory.mktemp("1E2P1D"))


def _router_log(dep: LocalDeployment) -> str:
    assert dep.log_dir is not None
    return (dep.log_dir / "router.log").read_text(errors="replace")


def _check_exact(results: list[dict[str, Any]], cases: list[servekit.Case], expected: list[list[int]]) -> None:
    for case, want, got in zip(cases, expected, results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case.index, got)
        assert got["finish_reason"] in ("stop", "length"), (case.index, got)
        assert got["token_ids"] == want, f"request {case.index} ({len(case.images)} images, stream={case.stream})"


def _wait_router_sees(dep: LocalDeployment, role: str, ready: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        roles = httpx.get(f"{dep.router_url}/health", timeout=10).json().get("roles", {})
        if roles.get(role, {}).get("ready") == ready:
            return
        assert time.monotonic() < deadline, f"router still reports {roles} after {timeout_s}s"
        time.sleep(0.2)


def _queued_stage_requests(port: int, min_bytes: int = 400) -> int:
    """Connections to `port` whose unread bytes look like a stage request (a /health probe
    is ~150 bytes; a `/internal/run` body carries token ids, images or handles). Read from
    /proc/net/tcp: the kernel accepts connections for a stopped process, so they show there."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if int(local.split(":")[1], 16) == port and state == "01" and int(queues.split(":")[1], 16) >= min_bytes:
            count += 1
    return count


async def _freeze_send_kill(dep: LocalDeployment, victim: Process, bodies: list[dict[str, Any]]
                            ) -> list[dict[str, Any]]:
    """Stop `victim` (SIGSTOP: its health probes hang, so the router still routes to it),
    send the requests, and SIGKILL it as soon as one of them waits at its socket: that
    request has surely met the dead instance, whatever the timing of the router's probes."""
    port = int(victim.url.rsplit(":", 1)[1])
    if not Path("/proc/net/tcp").is_file():
        pytest.skip("needs Linux /proc/net/tcp to see requests queued at the stopped instance")
    os.killpg(victim.popen.pid, signal.SIGSTOP)
    task = asyncio.ensure_future(servekit.run_all(dep.router_url, bodies, timeout_s=90))
    deadline = time.monotonic() + 20
    while not _queued_stage_requests(port) and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.02)
    os.killpg(victim.popen.pid, signal.SIGKILL)
    return await task


def _kill_then_serve(model: Path, dep: LocalDeployment, victim: Process, cases: list[servekit.Case]) -> None:
    """SIGKILL `victim` while requests are on their way to it; they are retried elsewhere
    and exact, and no survivor holds anything once the leases given to the dead instance
    have expired."""
    expected = [servekit.expected_ids(model, c) for c in cases]
    retries_before = _router_log(dep).count("retrying elsewhere")
    results = asyncio.run(_freeze_send_kill(dep, victim, [c.openai_body(model.name) for c in cases]))
    _check_exact(results, cases, expected)
    assert victim.popen.wait(timeout=10) == -signal.SIGKILL
    assert _router_log(dep).count("retrying elsewhere") > retries_before, _router_log(dep)[-3000:]
    servekit.assert_no_leaks(servekit.wait_idle(dep, timeout_s=LEASE_S + 20, skip={victim.name}))


def _restart_and_use(model: Path, dep: LocalDeployment, victim: Process, role: str, count: int,
                     cases: list[servekit.Case], counter: str) -> None:
    """Restart the killed worker in place; once the router sees it, requests reach it again."""
    fresh = dep.restart_worker(victim)
    _wait_router_sees(dep, role, count)
    expected = [servekit.expected_ids(model, c) for c in cases]
    before = servekit.stats_of(dep)[fresh.name]["counters"][counter]
    _check_exact(asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(model.name) for c in cases])),
                 cases, expected)
    assert servekit.stats_of(dep)[fresh.name]["counters"][counter] > before
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def test_encoder_killed_requests_retry_on_the_other(two_encoders: tuple[Path, LocalDeployment]) -> None:
    model, dep = two_encoders
    victim = servekit.worker(dep, "E", 0)
    # 1-3 images each: every request needs an encoder, and IRP sends 2- and 3-image
    # requests to both; distinct images, so no embedding is already cached anywhere.
    cases = [c for c in servekit.make_cases(12, seed_base=30_000) if c.images]
    _kill_then_serve(model, dep, victim, cases)
    three = [c for c in servekit.make_cases(4, seed_base=31_000) if len(c.images) == 3]
    _restart_and_use(model, dep, victim, "E", 2, three, "images_encoded")


def test_prefill_killed_requests_retry_on_the_other(two_prefills: tuple[Path, LocalDeployment]) -> None:
    model, dep = two_prefills
    victim = servekit.worker(dep, "P", 0)
    cases = servekit.make_cases(8, seed_base=32_000)  # with and without images
    _kill_then_serve(model, dep, victim, cases)
    # Round-robin over the two P instances: two requests in a row reach both.
    _restart_and_use(model, dep, victim, "P", 2, servekit.make_cases(2, seed_base=33_000), "prefill_tokens")


# --- the bad-input corpus --------------------------------------------------------------------


@pytest.fixture(scope="module")
def epd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LocalDeployment]]:
    yield from _deployment("EPD", tmp_path_factory.mktemp("EPD"))


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 50_000, height: int = 50_000) -> bytes:
    """A tiny PNG whose header claims width x height RGB pixels (7.5 GB decoded); the
    IDAT holds only a few compressed rows, so it is a few hundred bytes on the wire."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    rows = zlib.compress(b"\x00" * (1 + 3 * width) * 4, 9)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", rows)
            + _png_chunk(b"IEND", b""))


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _image_body(model: str, *urls: str, text: str = "Describe the picture.") -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def _bad_cases(model: str) -> dict[str, tuple[dict[str, Any] | bytes, str | None, str | None]]:
    """name -> (request body, or raw bytes sent as JSON; the error's `param`; its `code`),
    where None means the field may hold anything."""
    good_png = png_bytes(make_test_image(1, 56, 56))
    text = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    img = "messages[0].content[0].image_url"
    return {
        "malformed json": (b'{"model": "' + model.encode() + b'", "messages": [', None, "invalid_json"),
        "messages not a list": ({**text, "messages": "Hi"}, "messages", None),
        "max_tokens a string": ({**text, "max_tokens": "four"}, "max_tokens", None),
        "content part of unknown type": (
            {**text, "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]}]},
            "messages[0].content[0]", None),
        "bad base64": (_image_body(model, "data:image/png;base64,!!!not*base64@@"), img, "invalid_base64"),
        "bytes that are not an image": (
            _image_body(model, _data_url(b"hello, I am plain text" * 4)), img, "invalid_image"),
        # The router reads headers only: the encode instance finds the missing pixels, after the
        # router has let go of where the part sat in the request (no param, the code passes through).
        "truncated png": (_image_body(model, _data_url(good_png[: len(good_png) // 2])), None, "invalid_image"),
        # Past PIL's own bomb guard (2x its 89M-pixel warning) ...
        "decompression bomb 50000x50000": (_image_body(model, _data_url(bomb_png())), img, "image_too_large"),
        # ... and under it, but over the router's 4096x4096 limit (checked before decoding).
        "decompression bomb 8000x8000": (
            _image_body(model, _data_url(bomb_png(8000, 8000))), img, "image_too_large"),
        "file url": (_image_body(model, "file:///etc/passwd"), img, "invalid_image_url"),
        "http url (not allow-listed)": (
            _image_body(model, "http://example.com/cat.png"), img, "invalid_image_url"),
        # The router's default limit is 16 images per request (no CLI flag sets it).
        "too many images": (_image_body(model, *[_data_url(good_png)] * 17), "messages", "too_many_images"),
        "prompt over the context": (
            {**text, "messages": [{"role": "user", "content": "hello " * 33_000}]}, "messages",
            "context_length_exceeded"),
        "max_tokens over the context": ({**text, "max_tokens": 40_000}, "max_tokens", "context_length_exceeded"),
        "temperature < 0": ({**text, "temperature": -0.5}, "temperature", None),
        "temperature > 2": ({**text, "temperature": 2.5}, "temperature", None),
        "top_p 0": ({**text, "top_p": 0.0}, "top_p", None),
        "top_p > 1": ({**text, "top_p": 1.5}, "top_p", None),
        "max_tokens 0": ({**text, "max_tokens": 0}, "max_tokens", None),
        "max_tokens negative": ({**text, "max_tokens": -3}, "max_tokens", None),
    }


def test_bad_input_corpus_gets_openai_400s(epd: tuple[Path, LocalDeployment]) -> None:
    model, dep = epd
    failures = []
    with httpx.Client(timeout=60) as client:
        for name, (body, param, code) in _bad_cases(model.name).items():
            url = f"{dep.router_url}/v1/chat/completions"
            if isinstance(body, bytes):
                r = client.post(url, content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(url, json=body)
            try:
                data = r.json()
            except ValueError:
                failures.append(f"{name}: {r.status_code}, not JSON: {r.text[:200]}")
                continue
            err = data.get("error") if isinstance(data, dict) else None
            ok = (r.status_code == 400 and isinstance(err, dict)
                  and set(err) == {"message", "type", "param", "code"}
                  and isinstance(err["message"], str) and err["message"]
                  and err["type"] == "invalid_request_error"
                  and (param is None or err["param"] == param) and (code is None or err["code"] == code))
            if not ok:
                failures.append(f"{name}: {r.status_code} {data}")
    assert not failures, "\n".join(failures)
    # The deployment is unharmed: a good request still gets the exact answer.
    case = servekit.make_cases(2, seed_base=34_000)[1]
    want = servekit.expected_ids(model, case)
    (got,) = asyncio.run(servekit.run_all(dep.router_url, [case.openai_body(model.name)]))
    assert got["status"] == 200 and got["token_ids"] == want, got
    servekit.assert_no_leaks(servekit.wait_idle(dep))
