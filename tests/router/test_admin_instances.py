"""The router's `POST /admin/instances` and `DELETE /admin/instances/<id>`: a worker process
started after the router (the local planner's scaling, local_connector.py) is registered and
routed to, and forgotten again; the admin token guards both; bad bodies, unreachable or
duplicate workers and unknown ids are clear 4xx/5xx answers that change nothing; Kubernetes
discovery refuses both (the pods are the instance set there)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from triptych.router.config import RouterConfig
from triptych.router.main import build

TOKEN = "admin-instances-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class HealthServer:
    """A worker's `/health` and nothing else: what registration reads."""

    def __init__(self, instance_id: str, role: str) -> None:
        body = json.dumps({"status": "ok", "role": role, "instance_id": instance_id, "load": 0}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code = 200 if self.path == "/health" else 404
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def workers() -> Iterator[list[HealthServer]]:
    servers = [HealthServer("E-0", "E"), HealthServer("E-a0", "E"), HealthServer("E-0", "P")]
    yield servers
    for s in servers:
        s.close()


@pytest.fixture
def router(qwen2_vl_dir: Path, workers: list[HealthServer], monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("TRIPTYCH_ADMIN_TOKEN", TOKEN)
    config = RouterConfig(model=qwen2_vl_dir, served_model_name="m", max_model_len=256)
    with TestClient(build(config, [workers[0].url], poll_interval_s=30)) as client:
        yield client


def listed(client: TestClient) -> dict[str, str]:
    return {i["instance_id"]: i["url"] for i in client.get("/health", headers=ADMIN).json()["instances"]}


def test_a_registered_instance_is_listed_and_routed_then_forgotten(router: TestClient,
                                                                   workers: list[HealthServer]) -> None:
    r = router.post("/admin/instances", json={"url": workers[1].url + "/"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json() == {"instance_id": "E-a0", "url": workers[1].url, "ready": True, "role": "E"}
    assert listed(router) == {"E-0": workers[0].url, "E-a0": workers[1].url}
    assert router.get("/health").json()["roles"]["E"] == {"ready": 2, "total": 2}

    r = router.delete("/admin/instances/E-a0", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"instance_id": "E-a0", "url": workers[1].url}
    assert listed(router) == {"E-0": workers[0].url}
    assert router.get("/health").json()["roles"]["E"] == {"ready": 1, "total": 1}


def test_both_need_the_admin_token(router: TestClient, workers: list[HealthServer]) -> None:
    body = {"url": workers[1].url}
    assert router.post("/admin/instances", json=body).status_code == 401
    assert router.post("/admin/instances", json=body, headers={"Authorization": "Bearer no"}).status_code == 403
    assert router.delete("/admin/instances/E-0").status_code == 401
    assert router.delete("/admin/instances/E-0", headers={"Authorization": "Bearer no"}).status_code == 403
    assert listed(router) == {"E-0": workers[0].url}


def test_bad_registrations_change_nothing(router: TestClient, workers: list[HealthServer]) -> None:
    def refused(body: object, status: int) -> str:
        r = router.post("/admin/instances", json=body, headers=ADMIN)
        assert r.status_code == status, r.text
        return r.json()["error"]["message"]

    assert "expected" in refused({"url": "not a url"}, 400)
    assert "expected" in refused({"host": "x"}, 400)
    assert "registered already" in refused({"url": workers[0].url}, 409)
    assert "taken by" in refused({"url": workers[2].url}, 409)  # answers as E-0 too
    closed = HealthServer("E-gone", "E")
    closed.close()
    assert "did not answer" in refused({"url": closed.url}, 502)
    assert listed(router) == {"E-0": workers[0].url}
    r = router.delete("/admin/instances/E-nope", headers=ADMIN)
    assert r.status_code == 404 and "no instance 'E-nope'" in r.json()["error"]["message"]


def test_kubernetes_discovery_refuses_registration(qwen2_vl_dir: Path, workers: list[HealthServer],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    class Discovery:  # what build() needs of a KubernetesDiscovery: start, stop, current
        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

        def current(self) -> list:
            return []

    monkeypatch.setenv("TRIPTYCH_ADMIN_TOKEN", TOKEN)
    config = RouterConfig(model=qwen2_vl_dir, served_model_name="m", max_model_len=256)
    with TestClient(build(config, [], discovery=Discovery())) as client:
        r = client.post("/admin/instances", json={"url": workers[1].url}, headers=ADMIN)
        assert r.status_code == 409 and "Kubernetes" in r.json()["error"]["message"]
        assert client.delete("/admin/instances/E-0", headers=ADMIN).status_code == 409
