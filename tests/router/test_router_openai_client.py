"""The official OpenAI Python client against the router (in-process ASGI transport):
what a user's code sees - completions, streams with usage, errors as typed exceptions."""

from __future__ import annotations

import httpx
import pytest
from routerkit import REPLY, ScriptedBackend, data_url, reply_events, solid_png

from triptych.router.api import create_app
from triptych.router.backend import BackendError

openai = pytest.importorskip("openai")


def client_for(config, backend, processor) -> openai.AsyncOpenAI:
    app = create_app(config, backend, processor=processor)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router/v1")
    return openai.AsyncOpenAI(api_key="k1", base_url="http://router/v1", http_client=http, max_retries=0)


async def test_openai_client_chat_and_stream(config, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor))
    client = client_for(config.model_copy(update={"api_keys": ["k1"]}), backend, processor)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": data_url(solid_png()), "detail": "high"}}]}]
    resp = await client.chat.completions.create(model="tiny-qwen", messages=messages, max_tokens=20, seed=1)
    assert resp.choices[0].message.content == REPLY and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(processor.encode(REPLY)) + 1

    stream = await client.chat.completions.create(model="tiny-qwen", messages=messages, stream=True,
                                                  stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == REPLY and finish == "stop" and usage.total_tokens == resp.usage.total_tokens

    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen"]
    completion = await client.completions.create(model="tiny-qwen", prompt="Once", max_tokens=10)
    assert completion.choices[0].text == REPLY


async def test_openai_client_errors(config, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor))
    client = client_for(config, backend, processor)
    msg = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny-qwen", messages=msg, temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=msg)
    backend.fail_before_first = BackendError(429, "slow down", retry_after=1)
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model="tiny-qwen", messages=msg)
    assert limited.value.response.headers["retry-after"] == "1"
    backend.fail_before_first = None
    backend.fail_after = (2, BackendError(503, "decode instance died"))
    stream = await client.chat.completions.create(model="tiny-qwen", messages=msg, stream=True)
    with pytest.raises(openai.APIError, match="decode instance died"):
        async for _ in stream:
            pass


async def test_openai_client_auth(config, processor) -> None:
    backend = ScriptedBackend(script=lambda req: reply_events(processor))
    client = client_for(config.model_copy(update={"api_keys": ["other"]}), backend, processor)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "x"}])
