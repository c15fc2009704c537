"""Fixtures for the serving benchmark's client tests: the real router HTTP layer over a
scripted backend (tests/router/routerkit.py) and the real processor of the tiny Qwen2-VL."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROUTER_TESTS = Path(__file__).resolve().parent.parent / "router"
if str(ROUTER_TESTS) not in sys.path:  # lets these tests `import routerkit`
    sys.path.insert(0, str(ROUTER_TESTS))

from routerkit import ScriptedBackend, reply_events  # noqa: E402

from triptych.processor import MultimodalProcessor  # noqa: E402
from triptych.router.config import RouterConfig  # noqa: E402


@pytest.fixture(scope="session")
def processor(qwen2_vl_dir: Path) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(qwen2_vl_dir)


@pytest.fixture
def backend(processor: MultimodalProcessor) -> ScriptedBackend:
    return ScriptedBackend(script=lambda req: reply_events(processor))


@pytest.fixture
def config(qwen2_vl_dir: Path) -> RouterConfig:
    return RouterConfig(model=qwen2_vl_dir, served_model_name="tiny-qwen", max_model_len=512)
