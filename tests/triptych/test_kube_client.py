"""The shared Kubernetes client: where credentials come from, re-login after a 401, watch
errors. Against a small aiohttp server (the operator and discovery tests use kmock)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp.web
import pytest
import yaml

from triptych.kube.client import POD, KubeApiError, KubeClient, Login


def test_in_cluster_login_rereads_the_rotating_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / "token").write_text("first\n")
    first = Login.in_cluster(tmp_path)
    assert (first.server, first.token, first.ca_path) == ("https://[fd00::1]:443", "first", str(tmp_path / "ca.crt"))
    (tmp_path / "token").write_text("second")
    assert Login.in_cluster(tmp_path).token == "second"


def test_kubeconfig_login(tmp_path: Path) -> None:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "k", "cluster": {"server": "https://k.example:6443",
                                                     "insecure-skip-tls-verify": True}}],
              "users": [{"name": "u", "user": {"token": "s3cret"}}],
              "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    login = Login.from_kubeconfig(str(path))
    assert (login.server, login.scheme, login.token, login.insecure) == ("https://k.example:6443", "Bearer",
                                                                         "s3cret", True)


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[str]]]:
    """401 unless the token is 'new'; a watch that ends with a 410 ERROR event."""
    seen: list[str] = []

    async def pods(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != "Bearer new":
            return aiohttp.web.json_response({"message": "Unauthorized"}, status=401)
        if request.query.get("watch") != "true":
            return aiohttp.web.json_response({"items": [], "metadata": {"resourceVersion": "7"}})
        response = aiohttp.web.StreamResponse()
        await response.prepare(request)
        for event in ({"type": "ADDED", "object": {"metadata": {"name": "p"}}},
                      {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}):
            await response.write(json.dumps(event).encode() + b"\n")
        return response

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods", pods)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_a_401_logs_in_again_once(server: tuple[str, list[str]]) -> None:
    url, seen = server
    tokens = iter(["old", "new", "newer"])
    kube = KubeClient(lambda: Login(server=url, token=next(tokens)))
    try:
        assert await kube.list_versioned(POD, "ns", {"a": "b"}) == ([], "7")
        assert seen == ["Bearer old", "Bearer new"]
        await kube.list(POD, "ns", {})  # the new login is kept
        assert seen[-1] == "Bearer new"
    finally:
        await kube.aclose()


async def test_watch_yields_events_and_raises_on_error_events(server: tuple[str, list[str]]) -> None:
    url, _ = server
    kube = KubeClient(lambda: Login(server=url, token="new"))
    events = []
    try:
        with pytest.raises(KubeApiError) as err:
            async for event in kube.watch(POD, "ns", {}, resource_version="7", timeout_seconds=5):
                events.append(event)
    finally:
        await kube.aclose()
    assert events == [("ADDED", {"metadata": {"name": "p"}})]
    assert err.value.status == 410 and "too old" in str(err.value)
