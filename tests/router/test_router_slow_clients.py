"""Slow and vanished clients against a real uvicorn server on loopback (the ASGI transport
has no sockets): request heads trickled byte by byte are closed at the header deadline, and
an SSE client that stops reading is dropped at the send deadline, its request aborted and
the in-flight gauge back to 0."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from routerkit import ScriptedBackend, metric_value

from triptych.processor import MultimodalProcessor
from triptych.router.api import create_app
from triptych.router.backend import TokenEvent
from triptych.router.config import RouterConfig
from triptych.router.http_server import protocol_for


@pytest.fixture
async def served(processor: MultimodalProcessor, config: RouterConfig) -> AsyncIterator[tuple[str, ScriptedBackend]]:
    cfg = config.model_copy(update={"header_read_timeout_s": 0.5, "send_timeout_s": 0.5,
                                    "max_model_len": 32768})
    backend = ScriptedBackend(script=lambda req: [TokenEvent([42] * 8) for _ in range(4000)])
    listener = socket.socket()
    # Small kernel buffers (accepted sockets inherit them), so a client that stops reading
    # blocks the server's writes after kilobytes rather than megabytes.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, backend, processor=processor),
                                           log_level="critical", http=protocol_for(cfg)))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    yield f"127.0.0.1:{port}", backend
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_a_client_trickling_its_headers_is_closed_at_the_deadline(served) -> None:
    addr, _ = served
    host, port = addr.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    started = time.monotonic()
    closed_after = None
    for byte in head:  # one byte every 0.1 s: never completes within the 0.5 s deadline
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            closed_after = time.monotonic() - started
            break
        try:
            if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                closed_after = time.monotonic() - started
                break
        except TimeoutError:
            pass
    writer.close()
    assert closed_after is not None and closed_after < 2.0, closed_after


async def test_sse_client_that_stops_reading_is_dropped(served, processor) -> None:
    addr, backend = served
    backend.delay_s = 0.002  # tokens keep coming for ~8 s, as from a decoding instance
    host, port = addr.split(":")
    body = json.dumps({"model": "tiny-qwen", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 32000, "stream": True, "ignore_eos": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up fast, then never read
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    async with asyncio.timeout(30):
        while not backend.cancelled and not backend.closed:
            await asyncio.sleep(0.05)
    request_id = backend.requests[0].request_id
    assert request_id in backend.cancelled + backend.closed
    assert request_id not in backend.finished
    sock.setblocking(False)  # the server closed its side: draining what was sent reaches EOF
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while await loop.sock_recv(sock, 65536):
            pass
    sock.close()
    async with httpx.AsyncClient(trust_env=False) as client:
        text = (await client.get(f"http://{addr}/metrics")).text
    assert metric_value(text, "triptych_frontend_requests_in_flight") == 0
