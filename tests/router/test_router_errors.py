"""Every bad input gets a 4xx with OpenAI's error JSON (never FastAPI's 422, never a
500), and backend failures keep their status."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import pytest
from PIL import Image
from routerkit import (
    ScriptedBackend,
    chat_body,
    data_url,
    image_part,
    metric_value,
    parse_sse,
    reply_events,
    solid_png,
)

from triptych.router.backend import BackendError, TokenEvent

CHAT = "/v1/chat/completions"


def assert_openai_error(r: Any, status: int, *, param: str | None = "<any>", code: str | None = "<any>",
                        contains: str = "") -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 and status != 429 else err["type"])
    if param != "<any>":
        assert err["param"] == param, err
    if code != "<any>":
        assert err["code"] == code, err
    assert contains.lower() in err["message"].lower(), err
    return err


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (CRC fixed up): decoding it
    would need tens of GB, so only a check before decoding can refuse it in time."""
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = 8  # after the signature: length(4) type(4) data(13) crc(4)
    data[ihdr + 8:ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4:ihdr + 8 + 13]))
    data[ihdr + 8 + 13:ihdr + 8 + 17] = struct.pack(">I", crc)
    return bytes(data)


def with_parts(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return chat_body([{"type": "text", "text": "look"}, *parts], **extra)


IMG = "messages[0].content[1].image_url"
BAD_REQUESTS = [
    # (id, body or raw bytes, expected param, expected message fragment)
    ("malformed-json", b'{"model": "tiny-qwen", "messages": [', None, "malformed JSON"),
    ("not-an-object", b"[1, 2]", None, "dictionary"),
    ("empty-body", b"", None, "must be a JSON object"),
    ("missing-messages", {"model": "tiny-qwen"}, "messages", "required"),
    ("empty-messages", chat_body() | {"messages": []}, "messages", "at least 1"),
    ("wrong-type-content", chat_body(5), "messages[0].content", "string"),
    ("wrong-type-temperature", chat_body(temperature="hot"), "temperature", "number"),
    ("wrong-type-stream", chat_body(stream="yes please"), "stream", "boolean"),
    ("bad-role", chat_body() | {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "user"),
    ("unknown-part-type", chat_body([{"type": "audio", "audio": "x"}]), "messages[0].content[0]", "tag"),
    ("text-part-without-text", chat_body([{"type": "text"}]), "messages[0].content[0].text", "required"),
    ("unknown-part-field", chat_body([{"type": "text", "text": "x", "frobnicate": 1}]),
     "messages[0].content[0].frobnicate", "unrecognized"),
    ("bad-base64", with_parts(image_part(url="data:image/png;base64,@@@not base64@@@")), IMG, "base64"),
    ("not-base64-data-url", with_parts(image_part(url="data:image/png,rawbytes")), IMG, "base64"),
    ("non-image-media-type", with_parts(image_part(url=data_url(b"hello", "text/plain"))), IMG, "not an image"),
    ("bytes-not-an-image", with_parts(image_part(url=data_url(b"GIF? no, just text"))), IMG, "not a supported image"),
    # A truncated image whose header is intact passes the router (it reads headers only); the
    # encode instance decodes it and refuses it (tests/serving/test_failures.py, "truncated png").
    ("decompression-bomb", with_parts(image_part(bomb_png())), IMG, "too large"),
    ("file-url", with_parts(image_part(url="file:///etc/passwd")), IMG, "scheme"),
    ("ftp-url", with_parts(image_part(url="ftp://example.com/a.png")), IMG, "scheme"),
    ("http-url-disabled", with_parts(image_part(url="http://example.com/a.png")), IMG, "disabled"),
    ("video-http-url-disabled", chat_body([{"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]),
     "messages[0].content[0].video_url", "disabled"),
    ("temperature-high", chat_body(temperature=2.5), "temperature", "less than or equal to 2"),
    ("temperature-negative", chat_body(temperature=-0.1), "temperature", "greater than or equal"),
    ("top-p-zero", chat_body(top_p=0), "top_p", "greater than 0"),
    ("top-p-high", chat_body(top_p=1.5), "top_p", "less than or equal to 1"),
    ("top-k-negative", chat_body(top_k=-2), "top_k", "greater than or equal to 0"),
    ("max-tokens-zero", chat_body(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    ("max-completion-tokens-zero", chat_body(max_completion_tokens=0), "max_completion_tokens", ""),
    ("seed-huge", chat_body(seed=2**70), "seed", "less than"),
    ("too-many-stops", chat_body(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    ("empty-stop", chat_body(stop=[""]), "stop", "empty"),
    ("n-zero", chat_body(n=0), "n", "greater than or equal to 1"),
    ("n-negative", chat_body(n=-2), "n", "greater than or equal to 1"),
    ("n-huge", chat_body(n=1000), "n", "less than or equal to"),
    ("logit-bias-key", chat_body(logit_bias={"x5": 10}), "logit_bias", "token ids"),
    ("logit-bias-negative-id", chat_body(logit_bias={"-5": 10}), "logit_bias", "non-negative"),
    ("logit-bias-past-vocab", chat_body(logit_bias={"1000000000": 10}), "logit_bias", "outside the vocabulary"),
    ("stop-token-id-past-vocab", chat_body(stop_token_ids=[1, 10**9]), "stop_token_ids", "outside the vocabulary"),
    ("stop-token-id-negative", chat_body(stop_token_ids=[-1]), "stop_token_ids", ""),
    ("presence-penalty", chat_body(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    ("frequency-penalty", chat_body(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    ("repetition-penalty", chat_body(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    ("min-p", chat_body(min_p=1.5), "min_p", "less than or equal to 1"),
    ("top-logprobs-over-cap", chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
    ("top-logprobs-without-logprobs", chat_body(top_logprobs=2), "top_logprobs", "logprobs"),
    ("min-tokens-over-max", chat_body(min_tokens=30, max_tokens=3), "min_tokens", "at most max_tokens"),
    ("min-tokens-negative", chat_body(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
    ("best-of-below-n", chat_body(n=3, best_of=2), "best_of", "at least n"),
    ("truncate-zero", chat_body(truncate_prompt_tokens=0), "truncate_prompt_tokens", "greater than or equal"),
    ("template-kwargs-reserved", chat_body(chat_template_kwargs={"messages": []}), "chat_template_kwargs",
     "may not set"),
    ("tool-malformed-schema", chat_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]), "tools[0].function.parameters", "cannot be compiled"),
    ("tool-bad-pattern", chat_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string", "pattern": "("}}}]), "tools[0].function.parameters", "regex"),
    ("tool-duplicate-name", chat_body(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
     "tools[1].function.name", "duplicate"),
    ("tool-choice-without-tools", chat_body(tool_choice="required"), "tool_choice", "at least one tool"),
    ("tool-choice-unknown-name", chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
                                           tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "not in tools"),
    ("tool-choice-bad-value", chat_body(tool_choice="always"), "tool_choice", ""),
    ("json-schema-without-name", chat_body(response_format={"type": "json_schema", "json_schema": {}}),
     "response_format.json_schema.name", ""),
    ("json-schema-missing", chat_body(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    ("json-schema-uncompilable", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}),
     "response_format.json_schema.schema", "cannot be compiled"),
    ("response-format-unknown-type", chat_body(response_format={"type": "xml"}), "response_format.type", ""),
    ("functions-deprecated", chat_body(functions=[{"name": "f"}]), "functions", "use tools"),
    ("stream-options-without-stream", chat_body(stream_options={"include_usage": True}), "stream_options", ""),
    ("placeholder-in-text", chat_body("hi <|image_pad|> there"), "messages", "placeholder"),
    ("mm-kwargs-unknown-key", chat_body(mm_processor_kwargs={"zzz": 1}), "mm_processor_kwargs", "unsupported"),
    ("mm-kwargs-pixels-with-an-image", with_parts(image_part(solid_png()), mm_processor_kwargs={"max_pixels": 1}),
     "mm_processor_kwargs", "videos only"),
    # vLLM's extras: guided decoding (tests/router/test_router_vllm_extras.py has what they compile to)
    ("guided-two-kinds", chat_body(guided_regex="a", guided_choice=["b"]), "guided_choice", "only one kind"),
    ("guided-beside-response-format", chat_body(guided_regex="a", response_format={"type": "json_object"}),
     "guided_regex", "cannot be combined with response_format"),
    ("guided-beside-forced-tool", chat_body(guided_choice=["a"], tools=[{"type": "function", "function": {
        "name": "f"}}], tool_choice="required"), "guided_choice", "cannot be combined with tool_choice"),
    ("guided-regex-uncompilable", chat_body(guided_regex="("), "guided_regex", "cannot be compiled"),
    ("guided-json-not-json", chat_body(guided_json="{nope"), "guided_json", "not valid JSON"),
    ("guided-json-bad-schema", chat_body(guided_json={"type": "objekt"}), "guided_json", "cannot be compiled"),
    ("guided-choice-empty", chat_body(guided_choice=[]), "guided_choice", "at least 1"),
    ("structured-outputs-empty", chat_body(structured_outputs={}), "structured_outputs", "set one of"),
    ("structured-outputs-unknown-key", chat_body(structured_outputs={"structural_tag": "x"}),
     "structured_outputs.structural_tag", "unrecognized"),
    ("structured-outputs-bad-grammar", chat_body(structured_outputs={"grammar": "start: foo"}),
     "structured_outputs.grammar", "cannot be compiled"),
    # vLLM's extras we know but do not implement: refused, never silently ignored
    *[(f"unsupported-{name}", chat_body(**{name: value}), name, "not supported") for name, value in (
        ("prompt_logprobs", 1), ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]), ("logits_processors", ["x"]),
        ("guided_whitespace_pattern", " *"), ("chat_template", "{{ messages }}"),
        ("documents", [{"title": "t", "text": "x"}]), ("media_io_kwargs", {"video": {"num_frames": 4}}))],
    ("continue-final-with-generation-prompt", chat_body(continue_final_message=True) | {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "continue_final_message",
     "add_generation_prompt"),
    ("continue-final-after-a-user-message", chat_body(continue_final_message=True, add_generation_prompt=False),
     "continue_final_message", "assistant message last"),
    ("template-kwargs-reserved-continue", chat_body(chat_template_kwargs={"continue_final_message": True}),
     "chat_template_kwargs", "may not set"),
    ("video-placeholder-in-text", chat_body("hi <|video_pad|>"), "messages", "placeholder"),
]


@pytest.mark.parametrize(("body", "param", "fragment"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_requests_are_400_with_openai_errors(client, backend, body, param, fragment) -> None:
    if isinstance(body, bytes):
        r = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(CHAT, json=body)
    assert_openai_error(r, 400, param=param, contains=fragment)
    assert backend.requests == []  # nothing reached the backend


async def test_unknown_model_is_404(client) -> None:
    r = await client.post(CHAT, json=chat_body() | {"model": "gpt-5"})
    assert_openai_error(r, 404, param="model", code="model_not_found", contains="gpt-5")


async def test_too_many_images(config, make_client, backend) -> None:
    async with make_client(config.model_copy(update={"max_images_per_request": 2}), backend) as client:
        assert (await client.post(CHAT, json=with_parts(image_part(), image_part()))).status_code == 200
        r = await client.post(CHAT, json=with_parts(image_part(), image_part(), image_part()))
    assert_openai_error(r, 400, code="too_many_images", contains="at most 2")


async def test_pixel_limit_from_config(config, make_client, backend) -> None:
    async with make_client(config.model_copy(update={"max_image_pixels": 1000}), backend) as client:
        r = await client.post(CHAT, json=with_parts(image_part(solid_png(40, 40))))
    assert_openai_error(r, 400, param=IMG, code="image_too_large", contains="1000")


async def test_image_byte_limit(config, make_client, backend) -> None:
    async with make_client(config.model_copy(update={"max_image_bytes": 100}), backend) as client:
        r = await client.post(CHAT, json=with_parts(image_part(solid_png(64, 64) + b"\0" * 200)))
    assert_openai_error(r, 400, param=IMG, code="image_too_large")


async def test_prompt_over_the_context(config, make_client, backend) -> None:
    async with make_client(config.model_copy(update={"max_model_len": 40}), backend) as client:
        r = await client.post(CHAT, json=chat_body("word " * 50))
        assert_openai_error(r, 400, code="context_length_exceeded", contains="maximum context length is 40")
        ok = await client.post(CHAT, json=chat_body("hi"))
        prompt_len = ok.json()["usage"]["prompt_tokens"]
        r = await client.post(CHAT, json=chat_body("hi", max_tokens=40 - prompt_len + 1))
        assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")
        assert (await client.post(CHAT, json=chat_body("hi", max_tokens=40 - prompt_len))).status_code == 200


async def test_unknown_top_level_fields_are_ignored_and_logged(client, backend, caplog) -> None:
    # vLLM's behaviour: the request runs as if the field were absent, and the log says so.
    with caplog.at_level("WARNING", logger="triptych.router.protocol"):
        r = await client.post(CHAT, json=chat_body(frobnicate=True))
    assert r.status_code == 200, r.text
    assert len(backend.requests) == 1
    assert "frobnicate" in caplog.text


async def test_completions_errors(client) -> None:
    url = "/v1/completions"
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": ["a", "b"]}), 400,
                        param="prompt", contains="one prompt")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": ""}), 400, param="prompt")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": [1, 10**9]}), 400,
                        param="prompt", contains="vocabulary")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": "a", "echo": True,
                                                     "logprobs": 0}), 400, param="echo", contains="logprobs")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": "a", "suffix": "b"}), 400,
                        param="suffix")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": "a", "best_of": 3,
                                                     "stream": True}), 400, param="best_of")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": "a", "logprobs": 21}), 400,
                        param="logprobs")
    assert_openai_error(await client.post(url, json={"model": "tiny-qwen", "prompt": "a", "n": -1}), 400,
                        param="n")
    assert_openai_error(await client.post(url, json={"model": "x", "prompt": "a"}), 404, code="model_not_found")


async def test_unknown_route_and_method_use_openai_errors(client) -> None:
    assert_openai_error(await client.get("/v1/nothing"), 404)
    assert_openai_error(await client.get(CHAT), 405)


# --- API keys ---------------------------------------------------------------------------


async def test_api_keys(config, make_client, backend, tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key\n\n")
    cfg = config.model_copy(update={"api_keys": ["cli-key"], "api_key_file": key_file})
    async with make_client(cfg, backend) as client:
        assert_openai_error(await client.post(CHAT, json=chat_body()), 401, code="invalid_api_key",
                            contains="missing")
        bad = {"Authorization": "Bearer nope"}
        assert_openai_error(await client.post(CHAT, json=chat_body(), headers=bad), 401, code="invalid_api_key")
        assert_openai_error(await client.get("/v1/models", headers=bad), 401)
        # Authentication comes before validation: an unauthenticated client learns nothing.
        assert_openai_error(await client.post(CHAT, content=b"{", headers=bad), 401)
        for key in ("cli-key", "file-key"):
            r = await client.post(CHAT, json=chat_body(), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert_openai_error(await client.post(CHAT, json=chat_body(), headers={"Authorization": "Basic cli-key"}),
                            401)
        # Probes and metrics stay open (kubelet and Prometheus carry no key).
        for path in ("/health", "/live", "/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200
    assert len(backend.requests) == 2


async def test_request_body_limit(config, make_client, backend) -> None:
    async with make_client(config.model_copy(update={"max_request_bytes": 1000}), backend) as client:
        r = await client.post(CHAT, json=chat_body("x" * 2000))
        assert_openai_error(r, 413, code="request_too_large")

        async def chunks():  # no Content-Length: the cap applies while reading
            for _ in range(3):
                yield b" " * 600
        r = await client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert_openai_error(r, 413, code="request_too_large")


# --- backend failures -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("status", "retry_after", "header"), [(429, 2.5, "3"), (503, 1.0, "1"), (504, None, None)])
async def test_backend_errors_before_first_token_keep_their_status(
        config, make_client, status, retry_after, header, stream) -> None:
    backend = ScriptedBackend(script=lambda req: [],
                              fail_before_first=BackendError(status, "busy busy", retry_after=retry_after))
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body(stream=stream))
        err = assert_openai_error(r, status, contains="busy busy")
        assert r.headers.get("retry-after") == header
        assert err["type"] == ("rate_limit_error" if status == 429 else "server_error")
        metrics = (await client.get("/metrics")).text
    assert metric_value(metrics, "triptych_frontend_requests_total", status=str(status)) == 1


async def test_unexpected_backend_exception_is_a_500(config, make_client) -> None:
    backend = ScriptedBackend(script=lambda req: [], fail_before_first=RuntimeError("bug"))  # type: ignore[arg-type]
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body())
    err = assert_openai_error(r, 500, code="internal_error")
    assert "bug" not in err["message"]  # internals stay in the log


async def test_mid_stream_error_sends_error_event_then_done(config, make_client, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor),
                              fail_after=(3, BackendError(503, "decode instance died")))
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
        assert r.status_code == 200
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        error = events[-2]
        assert set(error) == {"error"} and error["error"]["message"] == "decode instance died"
        assert error["error"]["type"] == "server_error" and error["error"]["code"] == "service_unavailable"
        assert all("choices" in e for e in events[:-2])
        metrics = (await client.get("/metrics")).text
    assert metric_value(metrics, "triptych_frontend_requests_total", status="503") == 1
    assert metric_value(metrics, "triptych_frontend_requests_total", status="200") is None


async def test_mid_request_error_non_streaming(config, make_client, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor), fail_after=(2, BackendError(504, "slow")))
    async with make_client(config, backend) as client:
        assert_openai_error(await client.post(CHAT, json=chat_body()), 504, code="timeout")


async def test_backend_ending_without_finish_reason_is_an_error(config, make_client, processor) -> None:
    ids = processor.encode("cut short")
    backend = ScriptedBackend(script=lambda req: [TokenEvent(ids)])
    async with make_client(config, backend) as client:
        events = parse_sse((await client.post(CHAT, json=chat_body(stream=True))).text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] is None
        assert "without a finish reason" in events[-2]["error"]["message"]
        assert_openai_error(await client.post(CHAT, json=chat_body()), 502)


def test_bomb_png_really_claims_huge_dimensions(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # opening reads the header only
    with Image.open(io.BytesIO(bomb_png(70_000, 60_000))) as img:
        assert img.size == (70_000, 60_000)
    assert base64.b64encode(bomb_png())  # small enough to send inline
