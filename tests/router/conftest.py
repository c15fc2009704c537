"""Fixtures for the router's HTTP-layer tests: the real processor over the tiny Qwen2-VL
checkpoint, a scripted backend, and an app behind httpx's ASGI transport."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from routerkit import ScriptedBackend, reply_events

from triptych.processor import MultimodalProcessor
from triptych.router.api import create_app
from triptych.router.config import RouterConfig


@pytest.fixture(scope="session")
def processor(qwen2_vl_dir: Path) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(qwen2_vl_dir)


@pytest.fixture
def backend(processor: MultimodalProcessor) -> ScriptedBackend:
    return ScriptedBackend(script=lambda req: reply_events(processor))


@pytest.fixture
def config(qwen2_vl_dir: Path) -> RouterConfig:
    return RouterConfig(model=qwen2_vl_dir, served_model_name="tiny-qwen", max_model_len=512)


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


