"""The OpenAI-compatible API's happy paths, through the real processor (tiny Qwen2-VL)
and a scripted backend."""

from __future__ import annotations

import hashlib

import httpx
from routerkit import (
    REPLY,
    ScriptedBackend,
    chat_body,
    data_url,
    image_part,
    metric_value,
    parse_sse,
    reply_events,
    solid_png,
)

from triptych.router.backend import TokenEvent
from triptych.router.config import RouterConfig

CHAT = "/v1/chat/completions"


async def test_non_streaming_chat(client: httpx.AsyncClient, backend: ScriptedBackend, processor) -> None:
    r = await client.post(CHAT, json=chat_body(temperature=0.5, top_p=0.9, seed=7, max_tokens=20, user="u1"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny-qwen"
    assert r.headers["x-request-id"] == body["id"]
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                "logprobs": None, "finish_reason": "stop"}]
    (req,) = backend.requests
    expected = processor.process([{"role": "user", "content": "Say hello"}]).token_ids
    assert req.prompt_token_ids == expected and req.mm_items == [] and req.images == []
    assert req.request_id == body["id"]
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.max_tokens, s.top_k) == (0.5, 0.9, 7, 20, 0)
    n_out = len(processor.encode(REPLY)) + 1  # + EOS
    assert body["usage"] == {"prompt_tokens": len(expected), "completion_tokens": n_out,
                             "total_tokens": len(expected) + n_out}


async def test_max_tokens_defaults_to_the_rest_of_the_context(client, backend) -> None:
    r = await client.post(CHAT, json=chat_body())
    assert r.status_code == 200
    req = backend.requests[0]
    assert req.sampling.max_tokens == 512 - len(req.prompt_token_ids)


async def test_max_completion_tokens_wins_over_max_tokens(client, backend) -> None:
    r = await client.post(CHAT, json=chat_body(max_tokens=50, max_completion_tokens=9))
    assert r.status_code == 200
    assert backend.requests[0].sampling.max_tokens == 9


async def test_vllm_extras_pass_through(client, backend) -> None:
    r = await client.post(CHAT, json=chat_body(top_k=-1, ignore_eos=True, stop_token_ids=[5, 6], stop="zzz"))
    assert r.status_code == 200, r.text
    s = backend.requests[0].sampling
    assert (s.top_k, s.ignore_eos, s.stop_token_ids, s.stop) == (0, True, [5, 6], ["zzz"])


async def test_streaming_framing_and_done(client, backend) -> None:
    r = await client.post(CHAT, json=chat_body(stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY
    assert len(chunks) > 3  # really incremental, not one blob


async def test_streaming_include_usage(client, backend, processor) -> None:
    r = await client.post(CHAT, json=chat_body(stream=True, stream_options={"include_usage": True}))
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    *content, usage_chunk = events[:-1]
    assert all(c["usage"] is None for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    prompt = len(backend.requests[0].prompt_token_ids)
    out = len(processor.encode(REPLY)) + 1
    assert usage_chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": out,
                                    "total_tokens": prompt + out}


async def test_images_system_prompt_and_several_messages(client, backend, processor) -> None:
    red, blue = solid_png(64, 48, (255, 0, 0)), solid_png(28, 56, (0, 0, 255))
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(red),
                                     {"type": "image_url", "image_url": {"url": data_url(blue), "detail": "low"}}]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": "How?"},
    ]
    r = await client.post(CHAT, json={"model": "tiny-qwen", "messages": messages})
    assert r.status_code == 200, r.text
    req = backend.requests[0]
    assert req.images == [red, blue]
    hf = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
          {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]},
          {"role": "assistant", "content": "They differ."},
          {"role": "user", "content": "How?"}]
    expected = processor.process(hf, [red, blue])
    assert req.prompt_token_ids == expected.token_ids
    assert req.mm_items == expected.mm_items and len(req.mm_items) == 2
    assert [m.content_hash for m in req.mm_items] == [hashlib.sha256(b).hexdigest() for b in (red, blue)]
    assert (req.mm_items[0].width, req.mm_items[1].height) == (64, 56)


async def test_developer_role_is_a_system_prompt(client, backend, processor) -> None:
    body = {"model": "tiny-qwen", "messages": [{"role": "developer", "content": "Rules."},
                                              {"role": "user", "content": "Hi"}]}
    assert (await client.post(CHAT, json=body)).status_code == 200
    hf = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    assert backend.requests[0].prompt_token_ids == processor.process(hf).token_ids


async def test_stop_string_is_trimmed(client, backend) -> None:
    r = await client.post(CHAT, json=chat_body(stop=["world", "nope"]))
    assert r.json()["choices"][0]["message"]["content"] == "Hello there, "
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    r = await client.post(CHAT, json=chat_body(stop="o t", stream=True))
    chunks = parse_sse(r.text)[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Hell" and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_multibyte_text_streams_without_broken_characters(config, processor, make_client) -> None:
    reply = "Grüße 你好 🙂 done"
    backend = ScriptedBackend(script=lambda req: reply_events(processor, reply))
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
    pieces = [c["choices"][0]["delta"].get("content", "") for c in parse_sse(r.text)[:-1]]
    assert "".join(pieces) == reply
    assert not any("\ufffd" in p for p in pieces)
    # The tokenizer really splits these characters across tokens, so holding back mattered.
    assert any(processor.decode([t]).endswith("\ufffd") for t in processor.encode(reply))


async def test_finish_reason_length_and_max_tokens_enforced(config, processor, make_client) -> None:
    # A backend that overruns max_tokens and never finishes: the router ends it at max_tokens.
    ids = processor.encode("one two three four five six seven")
    backend = ScriptedBackend(script=lambda req: [TokenEvent([t]) for t in ids])
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body(max_tokens=3))
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["message"]["content"] == processor.decode(ids[:3])


async def test_backend_finish_length_is_reported(config, processor, make_client) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor, finish="length", eos=False))
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body(stream=True))
    chunks = parse_sse(r.text)[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completions_text_prompt(client, backend, processor) -> None:
    r = await client.post("/v1/completions", json={"model": "tiny-qwen", "prompt": "Once upon", "max_tokens": 30})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == REPLY and body["choices"][0]["finish_reason"] == "stop"
    assert backend.requests[0].prompt_token_ids == processor.encode("Once upon")
    assert backend.requests[0].sampling.max_tokens == 30


async def test_completions_token_prompt_and_stream(client, backend) -> None:
    body = {"model": "tiny-qwen", "prompt": [[10, 11, 12]], "stream": True,
            "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == REPLY
    assert events[-2]["choices"] == [] and events[-2]["usage"]["prompt_tokens"] == 3
    assert backend.requests[0].prompt_token_ids == [10, 11, 12]
    assert backend.requests[0].sampling.max_tokens == 16  # OpenAI's default for completions


async def test_models(client) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == "tiny-qwen" and card["object"] == "model" and card["max_model_len"] == 512
    assert (await client.get("/v1/models/tiny-qwen")).json()["id"] == "tiny-qwen"
    r = await client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_served_model_name_defaults_to_the_folder(qwen2_vl_dir) -> None:
    assert RouterConfig(model=qwen2_vl_dir).model_name == qwen2_vl_dir.name
    assert RouterConfig(model=qwen2_vl_dir).resolved_max_model_len() == 32768  # config.json


async def test_health_live_ready(config, processor, make_client) -> None:
    backend = ScriptedBackend(script=lambda req: [])
    async with make_client(config, backend) as client:
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        backend.health_report = {"status": "degraded", "roles": {"E": {"ready": 0, "total": 1}}}
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["roles"]["E"] == {"ready": 0, "total": 1}

        async def broken() -> dict:
            raise RuntimeError("registry exploded")
        backend.health = broken  # type: ignore[method-assign]
        r = await client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "unavailable"}  # no internals without the token
        assert (await client.get("/live")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
        backend.is_ready = False
        assert (await client.get("/ready")).status_code == 503


async def test_metrics_count_requests_tokens_and_latency(client, processor) -> None:
    await client.post(CHAT, json=chat_body())
    await client.post(CHAT, json=chat_body(stream=True))
    await client.post(CHAT, json=chat_body(temperature=9))
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    m = {"model": "tiny-qwen"}
    assert metric_value(text, "triptych_frontend_requests_total", status="200", **m) == 2
    assert metric_value(text, "triptych_frontend_requests_total", status="400", **m) == 1
    assert metric_value(text, "triptych_frontend_time_to_first_token_seconds_count", **m) == 2
    assert metric_value(text, "triptych_frontend_e2e_request_latency_seconds_count", **m) == 2
    n_out = len(processor.encode(REPLY)) + 1
    assert metric_value(text, "triptych_frontend_generation_tokens_total", **m) == 2 * n_out
    assert metric_value(text, "triptych_frontend_time_between_tokens_seconds_count", **m) == 2 * (n_out - 1)
    assert metric_value(text, "triptych_frontend_slo_requests_total", result="met", **m) == 2
    assert metric_value(text, "triptych_frontend_slo_attainment", **m) == 1.0
    assert metric_value(text, "triptych_frontend_requests_in_flight", **m) == 0


async def test_openapi_schema(client) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


async def test_continuous_usage_stats(client, processor) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = parse_sse((await client.post(CHAT, json=body)).text)[:-1]
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == len(processor.encode(REPLY)) + 1


async def test_health_with_a_malformed_report_is_503(config, make_client) -> None:
    backend = ScriptedBackend(script=lambda req: [])

    async def odd() -> list:
        return ["ok"]
    backend.health = odd  # type: ignore[method-assign]
    async with make_client(config, backend) as client:
        r = await client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"


def test_config_from_cli(qwen2_vl_dir, tmp_path) -> None:
    from triptych.cli import build_parser

    keys = tmp_path / "keys"
    keys.write_text("k2\n")
    args = build_parser().parse_args(
        ["router", "--model", str(qwen2_vl_dir), "--served-model-name", "m", "--api-key", "k1",
         "--api-key-file", str(keys), "--allow-http-images", "--image-host-allowlist", "a.org", "*.b.org"])
    cfg = RouterConfig.from_cli(args, ttft_slo_s=1.5)
    assert cfg.model_name == "m" and cfg.load_api_keys() == {"k1", "k2"}
    assert cfg.allow_http_images and cfg.image_host_allowlist == ["a.org", "*.b.org"]
    assert cfg.ttft_slo_s == 1.5


async def test_null_fields_mean_their_defaults(client, backend) -> None:
    body = chat_body(n=None, stream=None, presence_penalty=None, frequency_penalty=None, temperature=None,
                     stop=None, logprobs=None, tools=None, skip_special_tokens=None, ignore_eos=None)
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY
    assert backend.requests[0].sampling.temperature == 1.0


async def test_return_token_ids_in_both_modes(client, backend, processor) -> None:
    """vLLM's `return_token_ids` extra: the choice carries exactly the tokens generated."""
    want = [t for event in reply_events(processor) for t in event.token_ids]
    r = await client.post(CHAT, json=chat_body(return_token_ids=True))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    r = await client.post(CHAT, json=chat_body(return_token_ids=True, stream=True))
    chunks = parse_sse(r.text)[:-1]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == want
    plain = await client.post(CHAT, json=chat_body())
    assert "token_ids" not in plain.json()["choices"][0]
