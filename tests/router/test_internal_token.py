"""The router sends the internal token on every worker call, and reads it from the
environment or a file; a worker refusing it is a failed instance, not the client's error."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fakeworkers import INTERNAL_TOKEN, FakeCluster, collect, expected_tokens, request

from triptych.router.backend import BackendError
from triptych.router.config import RouterConfig
from triptych.router.stage_client import worker_client


async def test_requests_carry_the_token_and_aborts_reach_the_workers() -> None:
    async with FakeCluster("1E1P1D") as cluster:
        orch = cluster.orchestrator()
        req = request(images=("a",))
        assert await collect(orch, req) == (expected_tokens(req), "length")
        await orch.stages.abort([cluster["d0"].url], ["gone"], timeout_s=5)
        assert ("d0", "gone") in cluster.aborts()


async def test_without_the_token_no_run_gets_through_and_the_client_sees_no_401() -> None:
    async with FakeCluster("1E1P1D") as cluster:
        await cluster.client.aclose()
        cluster.client = httpx.AsyncClient()  # a router started without the internal token
        orch = cluster.orchestrator()
        with pytest.raises(BackendError) as err:
            await collect(orch, request(images=("a",)))
        assert err.value.status_code >= 500  # the deployment's fault, never a 401/403 to the client
        assert all(not w.runs for w in cluster.workers.values())
        await orch.stages.abort([cluster["d0"].url], ["x"], timeout_s=5)
        assert not cluster.aborts()


def test_internal_token_from_env_or_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, qwen2_vl_dir: Path) -> None:
    monkeypatch.delenv("TRIPTYCH_INTERNAL_TOKEN", raising=False)
    assert RouterConfig(model=qwen2_vl_dir).load_internal_token() is None
    monkeypatch.setenv("TRIPTYCH_INTERNAL_TOKEN", "from-env")
    assert RouterConfig(model=qwen2_vl_dir).load_internal_token() == "from-env"
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    assert RouterConfig(model=qwen2_vl_dir, internal_token_file=f).load_internal_token() == "from-file"
    assert worker_client(INTERNAL_TOKEN).headers["authorization"] == f"Bearer {INTERNAL_TOKEN}"
