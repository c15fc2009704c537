"""Shared fixtures: tiny checkpoints of each family, built once per code version.

TRIPTYCH_CACHE (unless already set) points to a temp directory keyed by a hash of the
checkpoint generator's source, set at import time so subprocesses started by tests
(workers, routers) inherit it and find the same builds. `tiny_model_path` builds under a
file lock and renames into place, so parallel pytest processes share the builds safely.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import pytest

import triptych.tiny_model as _tiny_model

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # lets tests `import hf_reference`
    sys.path.insert(0, str(TESTS_DIR))

from routerkit import ScriptedBackend, reply_events  # noqa: E402

from triptych.processor import MultimodalProcessor  # noqa: E402
from triptych.router.config import RouterConfig  # noqa: E402

_GENERATOR_HASH = hashlib.sha256(Path(_tiny_model.__file__).read_bytes()).hexdigest()[:12]
os.environ.setdefault("TRIPTYCH_CACHE", str(Path(tempfile.gettempdir()) / f"triptych-test-{_GENERATOR_HASH}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA; `e2e` tests need a cluster (TRIPTYCH_E2E_KUBECONFIG)."""
    import torch

    skips = {
        "gpu": None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA"),
        "e2e": None if os.environ.get("TRIPTYCH_E2E_KUBECONFIG") else
        pytest.mark.skip(reason="needs a cluster: set TRIPTYCH_E2E_KUBECONFIG"),
    }
    for item in items:
        for name, skip in skips.items():
            if skip is not None and item.get_closest_marker(name) is not None:  # not keywords: "gpu" may name a folder
                item.add_marker(skip)


def tiny_dir(family: str, size: str = "tiny", seed: int = 0) -> Path:
    """The tiny checkpoint directory of `family` (built on first use)."""
    return _tiny_model.tiny_model_path(family, size=size, seed=seed)


@pytest.fixture(scope="session")
def qwen2_vl_dir() -> Path:
    return tiny_dir("qwen2-vl")


@pytest.fixture(scope="session")
def qwen25_vl_dir() -> Path:
    return tiny_dir("qwen2.5-vl")


@pytest.fixture(scope="session")
def llava_dir() -> Path:
    return tiny_dir("llava")


@pytest.fixture(scope="session", params=list(_tiny_model.FAMILIES))
def tiny_model_dir(request: pytest.FixtureRequest) -> Path:
    """Parametrized over every family: a test using it runs once per family."""
    return tiny_dir(request.param)


# -- the router's HTTP layer over a scripted backend (router and bench tests) -------------

@pytest.fixture(scope="session")
def processor(qwen2_vl_dir: Path) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(qwen2_vl_dir)


@pytest.fixture
def backend(processor: MultimodalProcessor) -> ScriptedBackend:
    return ScriptedBackend(script=lambda req: reply_events(processor))


@pytest.fixture
def config(qwen2_vl_dir: Path) -> RouterConfig:
    return RouterConfig(model=qwen2_vl_dir, served_model_name="tiny-qwen", max_model_len=512)
