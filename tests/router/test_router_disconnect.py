"""A client that goes away aborts its request on the backend: the backend's iterator is
cancelled (the orchestrator aborts every stage there), for streaming and non-streaming
requests, through a raw ASGI driver and through a real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from routerkit import ScriptedBackend, chat_body, metric_value

from triptych.router.api import create_app
from triptych.router.backend import TokenEvent

CHAT = "/v1/chat/completions"


def slow_backend(processor, n: int = 200, delay_s: float = 0.02) -> ScriptedBackend:
    ids = processor.encode("tick ")
    return ScriptedBackend(script=lambda req: [TokenEvent(ids) for _ in range(n)], delay_s=delay_s)


async def wait_for(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def drive(app: Any, body: dict[str, Any], disconnect_after_chunks: int | None,
                disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    """Run one HTTP request through the ASGI app; the 'client' disconnects after it has
    seen `disconnect_after_chunks` body chunks, or after `disconnect_after_s`."""
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5555), "server": ("router", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


async def test_stream_disconnect_cancels_the_backend(config, processor) -> None:
    backend = slow_backend(processor)
    app = create_app(config, backend, processor=processor)
    sent = await drive(app, chat_body(stream=True), disconnect_after_chunks=3)
    (req,) = backend.requests
    await wait_for(lambda: req.request_id in backend.cancelled)
    assert req.request_id not in backend.finished
    assert sent[0]["status"] == 200
    assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)  # cut off, not finished
    metrics = app.state.triptych.metrics
    assert metrics.in_flight.labels("tiny-qwen")._value.get() == 0
    assert metrics.requests.labels("tiny-qwen", "499")._value.get() == 1


async def test_disconnect_before_first_token_cancels_the_backend(config, processor) -> None:
    # Prefill takes long (first event after 0.5 s); the client leaves after 0.1 s.
    backend = slow_backend(processor, n=3, delay_s=0.5)
    app = create_app(config, backend, processor=processor)
    sent = await drive(app, chat_body(stream=True), disconnect_after_chunks=None, disconnect_after_s=0.1)
    await wait_for(lambda: backend.requests and backend.requests[0].request_id in backend.cancelled, 2.0)
    assert not any(m.get("body") and b"data:" in m["body"] for m in sent)


async def test_non_stream_disconnect_cancels_the_backend(config, processor) -> None:
    backend = slow_backend(processor)
    app = create_app(config, backend, processor=processor)
    await drive(app, chat_body(), disconnect_after_chunks=None, disconnect_after_s=0.15)
    (req,) = backend.requests
    await wait_for(lambda: req.request_id in backend.cancelled, 2.0)
    assert app.state.triptych.metrics.requests.labels("tiny-qwen", "499")._value.get() == 1


async def test_stop_string_aborts_the_rest_of_the_generation(config, processor, make_client) -> None:
    backend = slow_backend(processor, n=50, delay_s=0.01)
    async with make_client(config, backend) as client:
        r = await client.post(CHAT, json=chat_body(stop=[" tick"]))
    assert r.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "tick"},
                                      "logprobs": None, "finish_reason": "stop"}
    await wait_for(lambda: backend.requests[0].request_id in backend.cancelled)


class _Server:
    """uvicorn on an ephemeral loopback port, inside the test's event loop."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> str:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await wait_for(lambda: self.server.started)
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout=5)
        self.sock.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_tcp_disconnect_through_uvicorn_cancels_the_backend(config, processor, stream) -> None:
    backend = slow_backend(processor)
    app = create_app(config, backend, processor=processor)
    async with _Server(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            if stream:
                async with client.stream("POST", CHAT, json=chat_body(stream=True)) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    first = await anext(lines)
                    assert first.startswith("data: ")
                # leaving the block closes the connection mid-stream
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(CHAT, json=chat_body(), timeout=0.2)
            await wait_for(lambda: bool(backend.cancelled), 5.0)
        (req,) = backend.requests
        assert backend.cancelled == [req.request_id] and not backend.finished
        # The server still serves the next request normally.
        backend.script = lambda req: [TokenEvent(processor.encode("ok"), finish_reason="stop")]
        backend.delay_s = 0
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            r = await client.post(CHAT, json=chat_body())
            assert r.json()["choices"][0]["message"]["content"] == "ok"
            metrics = (await client.get("/metrics")).text
    assert metric_value(metrics, "triptych_frontend_requests_total", status="499") == 1
    assert metric_value(metrics, "triptych_frontend_requests_in_flight") == 0
