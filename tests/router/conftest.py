"""Fixtures for the router's HTTP-layer tests: an app behind httpx's ASGI transport (the
processor, scripted backend and config fixtures are in tests/conftest.py, shared with the
benchmark's tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from routerkit import ScriptedBackend

from triptych.processor import MultimodalProcessor
from triptych.router.api import create_app
from triptych.router.config import RouterConfig


@pytest.fixture
def make_client(processor: MultimodalProcessor) -> Callable[..., httpx.AsyncClient]:
    def make(config: RouterConfig, backend: ScriptedBackend) -> httpx.AsyncClient:
        app = create_app(config, backend, processor=processor)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                 timeout=10.0)
    return make


@pytest.fixture
async def client(config: RouterConfig, backend: ScriptedBackend,
                 make_client: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(config, backend) as c:
        yield c


