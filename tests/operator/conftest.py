"""Fixtures for the operator tests; the harness itself lives in kube_harness.py (a unique
module name: several test folders have a conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import kmock
import pytest
from kube_harness import TEST_AGENT, Cluster, Env, api_server, free_port


@pytest.fixture
def service_monitors() -> bool:
    return False


@pytest.fixture
async def env(service_monitors: bool) -> AsyncIterator[Env]:
    async with api_server(service_monitors) as (api, url):
        async with aiohttp.ClientSession(base_url=url, headers={"User-Agent": TEST_AGENT}) as client:
            e = Env(api, Cluster(api, client, free_port()), url)
            try:
                yield e
            finally:
                for op in e.operators:
                    await op.stop()
                await e.cluster.stop_workers()
        unexpected = [err for err in api.errors if not isinstance(err, kmock.KubernetesError)]
        assert not unexpected, f"the API emulator failed: {unexpected!r}"
