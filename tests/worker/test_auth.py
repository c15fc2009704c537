"""The worker's two token scopes (worker/auth.py) over its real HTTP app, and the open
endpoints that must stay open and free of secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from triptych.worker.auth import MissingTokenError, WorkerAuth, bearer
from triptych.worker.server import create_app
from triptych.worker.settings import WorkerSettings

INTERNAL, ADMIN = "internal-secret-token", "admin-secret-token"


@pytest.fixture
def client() -> TestClient:
    app = create_app(WorkerSettings(model="unused", instance_id="w-auth"), WorkerAuth(INTERNAL, ADMIN))
    with TestClient(app) as c:
        yield c


def test_admin_role_without_token_is_401_and_role_unchanged(client: TestClient) -> None:
    r = client.post("/admin/role", json={"role": "unassigned"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "admin token" in r.json()["error"]["message"]
    r = client.post("/admin/role", json={"role": "P"})  # would load a model if it got through
    assert r.status_code == 401
    assert client.get("/health").json()["role"] == "unassigned"


def test_wrong_scope_is_403(client: TestClient) -> None:
    assert client.post("/admin/role", json={"role": "P"}, headers=bearer(INTERNAL)).status_code == 403
    assert client.get("/admin/stats", headers=bearer(INTERNAL)).status_code == 403
    assert client.post("/internal/abort/r1", headers=bearer(ADMIN)).status_code == 403
    assert client.post("/internal/run", json={}, headers=bearer(ADMIN)).status_code == 403
    assert client.post("/internal/channel?id=c", headers=bearer(ADMIN)).status_code == 403
    assert client.post("/internal/channel/c/cancel/0", headers=bearer(ADMIN)).status_code == 403
    assert client.post("/internal/channel?id=c").status_code == 401
    feeds = {"feeds": [{"request_id": "r1", "start": 2, "token_ids": [5], "lead": True}]}
    assert client.post("/internal/feed", json=feeds, headers=bearer(ADMIN)).status_code == 403
    assert client.post("/internal/feed", json=feeds).status_code == 401
    assert client.get("/health").json()["role"] == "unassigned"


def test_unknown_or_malformed_token_is_401(client: TestClient) -> None:
    for headers in (bearer("nope"), {"authorization": ADMIN}, {"authorization": "Basic " + ADMIN},
                    bearer(ADMIN + "x"), {"authorization": "Bearer "}):
        assert client.get("/admin/stats", headers=headers).status_code == 401, headers
        assert client.post("/internal/abort/r1", headers=headers).status_code == 401, headers


def test_right_scope_gets_through(client: TestClient) -> None:
    assert client.get("/admin/stats", headers=bearer(ADMIN)).json()["instance_id"] == "w-auth"
    bad = client.post("/admin/role", json={"role": "XYZ"}, headers=bearer(ADMIN))
    assert bad.status_code == 400  # past auth: the role itself is refused
    assert client.post("/internal/abort/r1", headers=bearer(INTERNAL)).json() == {"aborted": "r1"}
    # Unassigned: the stage run is refused by the instance (503), not by auth.
    sreq = {"request_id": "r1", "stages": ["prefill"], "prompt_token_ids": [1]}
    assert client.post("/internal/run", json=sreq, headers=bearer(INTERNAL)).status_code == 503


def test_feeds_get_an_answer_each_and_a_bad_batch_a_422(client: TestClient) -> None:
    """`POST /internal/feed` (router/feeds.py's batches): one answer per feed, in order; no
    live takeover runs here, so none is taken. An empty or malformed batch is refused."""
    feeds = {"feeds": [{"request_id": "r1", "start": 2, "token_ids": [5], "lead": True},
                       {"request_id": "r2", "start": 0, "token_ids": [6, 7]}]}
    r = client.post("/internal/feed", json=feeds, headers=bearer(INTERNAL))
    assert r.status_code == 200 and r.json() == {"taken": [False, False]}
    for bad in ({"feeds": []}, {"feeds": [{"request_id": "r1", "start": 0}]}, {"request_id": "r1", "start": 0}):
        r = client.post("/internal/feed", json=bad, headers=bearer(INTERNAL))
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("invalid feeds"), (bad, r.text)


def test_open_endpoints_need_no_token_and_leak_no_secret(client: TestClient) -> None:
    for path in ("/health", "/ready", "/live", "/metrics"):
        r = client.get(path)
        assert r.status_code == (503 if path == "/ready" else 200), path  # unassigned: alive, not ready
        for secret in (INTERNAL, ADMIN, "agent_metadata", "lease_id", "lease_secret"):
            assert secret not in r.text, (path, secret)


def test_live_stays_200_while_loading_or_draining(client: TestClient) -> None:
    inst = client.app.state.instance
    for flag in ("loading", "draining"):
        setattr(inst, flag, True)
        try:
            assert client.get("/health").status_code == 503
            assert client.get("/ready").status_code == 503
            assert client.get("/live").status_code == 200
        finally:
            setattr(inst, flag, False)


def test_admin_scope_disabled_without_admin_token() -> None:
    app = create_app(WorkerSettings(model="unused"), WorkerAuth(INTERNAL, None))
    with TestClient(app) as c:
        assert c.get("/admin/stats", headers=bearer(INTERNAL)).status_code == 403
        assert c.get("/admin/stats", headers=bearer("guess")).status_code == 403
        assert c.get("/admin/stats").status_code == 401


def test_load_refuses_to_start_without_internal_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TRIPTYCH_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("TRIPTYCH_ADMIN_TOKEN", raising=False)
    with pytest.raises(MissingTokenError, match="--insecure-no-auth"):
        WorkerAuth.load()
    assert WorkerAuth.load(insecure=True).insecure
    monkeypatch.setenv("TRIPTYCH_INTERNAL_TOKEN", "from-env")
    assert WorkerAuth.load().internal_token == "from-env"
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    auth = WorkerAuth.load(internal_file=str(f), admin_file=str(f))
    assert (auth.internal_token, auth.admin_token) == ("from-file", "from-file")


def test_worker_cli_exits_without_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from triptych.cli import main

    monkeypatch.delenv("TRIPTYCH_INTERNAL_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="no internal token"):
        main(["worker", "--model", "unused", "--port", "1"])


def test_live_stays_200_through_a_slow_role_switch(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch that takes long (loading a big checkpoint: 90 s is not unusual) must not get
    the container killed: liveness answers 200 throughout while health/ready say not now."""
    import threading
    import time

    from triptych.worker.instance import InstanceRuntime

    def slow_build(self: InstanceRuntime, role: object) -> None:
        time.sleep(3.0)
        raise RuntimeError("no model here")  # the switch fails after its long load

    monkeypatch.setattr(InstanceRuntime, "_build", slow_build)
    done: list[int] = []
    switch = threading.Thread(target=lambda: done.append(
        client.post("/admin/role", json={"role": "P"}, headers=bearer(ADMIN)).status_code))
    switch.start()
    seen = []
    while switch.is_alive():
        seen.append((client.get("/live").status_code, client.get("/ready").status_code))
        time.sleep(0.2)
    switch.join()
    assert len(seen) >= 5 and all(live == 200 and ready == 503 for live, ready in seen), seen
    assert done and done[0] >= 500  # the failed load is reported, and the worker stays up
    assert client.get("/live").status_code == 200
