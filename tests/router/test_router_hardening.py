"""The public API's limits and exposure: caps that bound a request's cost (each a 400 with an
OpenAI error body), images sized from their headers under a per-request pixel budget, the
admin-only detail of /health, body read deadlines, and the bind guard."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import resource

import pytest
from hf_reference import png_bytes as pil_png_bytes
from PIL import Image
from routerkit import ScriptedBackend, reply_events

from triptych.processor import ImageInput, decode_image, probe_image
from triptych.router.config import RouterConfig
from triptych.router.http_server import check_bind, is_loopback
from triptych.sampling_params import SamplingParams


def _chat(content: object = "Hi", **extra: object) -> dict:
    return {"model": "tiny-qwen", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _png_url(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


async def _error(client, body: dict, status: int = 400) -> dict:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()["error"]


async def test_a_megabyte_stop_string_is_a_400(client, backend) -> None:
    err = await _error(client, _chat(stop=["x" * 1_000_000]))
    assert err["param"] == "stop" and "at most 1024 characters" in err["message"]
    assert not backend.requests


async def test_too_many_stop_token_ids_is_a_400(client, backend) -> None:
    assert (await client.post("/v1/chat/completions", json=_chat(stop_token_ids=list(range(64))))).status_code == 200
    err = await _error(client, _chat(stop_token_ids=list(range(65))))
    assert err["param"] == "stop_token_ids"


async def test_message_part_and_text_caps(config, make_client, backend) -> None:
    cfg = config.model_copy(update={"max_messages": 3, "max_content_parts": 4, "max_prompt_chars": 100})
    async with make_client(cfg, backend) as client:
        many = {"model": "tiny-qwen", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}] * 4}
        assert (await _error(client, many))["code"] == "too_many_messages"
        parts = [{"type": "text", "text": "a"}] * 5
        assert (await _error(client, _chat(parts)))["code"] == "too_many_content_parts"
        assert (await _error(client, _chat("x" * 101)))["code"] == "prompt_too_long"
        r = await client.post("/v1/completions", json={"model": "tiny-qwen", "prompt": "y" * 101, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
        assert (await client.post("/v1/chat/completions", json=_chat("x" * 100))).status_code == 200


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=1e-300).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy


def _solid_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height), 7).save(buf, format="PNG")
    return buf.getvalue()


async def test_sixteen_huge_images_are_refused_before_any_decode(config, make_client, backend) -> None:
    big = _solid_png(4096, 4096)  # compresses to a few tens of KB; decoded it is 16 MiB each
    body = _chat([_png_url(big) for _ in range(16)] + [{"type": "text", "text": "hi"}])
    async with make_client(config, backend) as client:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        err = await _error(client, body)
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert err["code"] == "image_too_large" and "pixels in all" in err["message"]
    assert grown_mb < 200, grown_mb
    assert not backend.requests


def test_probe_reads_the_size_from_the_header_with_exif_orientation() -> None:
    img = Image.new("RGB", (40, 20), (1, 2, 3))
    for fmt in ("JPEG", "PNG", "WEBP"):
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90: displayed 20x40
        buf = io.BytesIO()
        img.save(buf, format=fmt, exif=exif.tobytes())
        data = buf.getvalue()
        assert probe_image(data) == decode_image(data).size == (20, 40), fmt
    truncated = pil_png_bytes(img)[:60]  # header intact, pixels missing: found by the encoder
    assert ImageInput.probe(truncated).size == (40, 20)


async def test_health_detail_only_for_the_admin_token(config, make_client, backend, monkeypatch) -> None:
    backend.health_report = {"status": "ok", "roles": {"EPD": {"ready": 1, "total": 1}}, "stages": {},
                             "instances": [{"url": "http://10.1.2.3:8100", "instance_id": "pod-a"}]}
    monkeypatch.setenv("TRIPTYCH_ADMIN_TOKEN", "s3cret")
    async with make_client(config, backend) as client:
        public = (await client.get("/health")).json()
        assert "instances" not in public and "10.1.2.3" not in str(public)
        assert public["roles"] == {"EPD": {"ready": 1, "total": 1}}
        wrong = (await client.get("/health", headers={"Authorization": "Bearer nope"})).json()
        assert "instances" not in wrong
        admin = (await client.get("/health", headers={"Authorization": "Bearer s3cret"})).json()
        assert admin["instances"][0]["instance_id"] == "pod-a"


async def test_api_key_from_the_environment(config, make_client, backend, monkeypatch) -> None:
    monkeypatch.setenv("TRIPTYCH_API_KEY", "k1,k2")
    async with make_client(config, backend) as client:
        assert (await client.post("/v1/chat/completions", json=_chat())).status_code == 401
        ok = await client.post("/v1/chat/completions", json=_chat(), headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200


async def test_a_trickled_body_gets_408_within_the_deadline(config, make_client, processor) -> None:
    from triptych.router.api import create_app

    cfg = config.model_copy(update={"body_read_timeout_s": 0.3})
    app = create_app(cfg, ScriptedBackend(script=lambda req: reply_events(processor)), processor=processor)
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(0.1)  # one byte a tenth of a second, forever
        return {"type": "http.request", "body": b"{", "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
             "query_string": b"", "raw_path": b"/v1/chat/completions", "root_path": "", "scheme": "http",
             "server": ("router", 80), "client": ("c", 1), "http_version": "1.1", "asgi": {"version": "3.0"}}
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(app(scope, receive, send), 5)
    assert asyncio.get_running_loop().time() - started < 1.5
    assert sent[0]["status"] == 408


def test_bind_guard(qwen2_vl_dir) -> None:
    cfg = RouterConfig(model=qwen2_vl_dir)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    check_bind("127.0.0.1", cfg, allow_no_api_key=False)
    with pytest.raises(SystemExit, match="without API keys"):
        check_bind("0.0.0.0", cfg, allow_no_api_key=False)
    check_bind("0.0.0.0", cfg, allow_no_api_key=True)
    check_bind("0.0.0.0", cfg.model_copy(update={"api_keys": ["k"]}), allow_no_api_key=False)
    assert os.environ.get("TRIPTYCH_API_KEY") is None
