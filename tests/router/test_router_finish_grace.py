"""A request its backend finished is not aborted: after the last finish the router lets
the backend end its stage streams by itself (reading the end of the worker's answer keeps
the connection pooled) instead of cancelling it, which would send aborts for a finished
request. A choice the router cuts (a stop string) is still aborted at once: see
test_router_disconnect.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from routerkit import ScriptedBackend, chat_body

from triptych.router.backend import GenerationRequest, TokenEvent


class _SlowToEnd(ScriptedBackend):
    """Sends its finish, then takes a moment to end (closing a worker's response)."""

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        try:
            yield TokenEvent([self.token], finish_reason="length")
            await asyncio.sleep(0.05)
            self.finished.append(req.request_id)
        except asyncio.CancelledError:
            self.cancelled.append(req.request_id)
            raise


@pytest.mark.parametrize("stream", [False, True])
async def test_a_finished_request_ends_without_an_abort(config, processor, make_client, stream: bool) -> None:
    backend = _SlowToEnd(script=lambda req: [])
    backend.token = processor.encode("tick")[0]
    async with make_client(config, backend) as client:
        r = await client.post("/v1/chat/completions", json=chat_body(stream=stream, max_tokens=1))
    assert r.status_code == 200
    assert backend.cancelled == [] and backend.finished == [backend.requests[0].request_id]
