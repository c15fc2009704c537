"""The local planner against a stub router: decisions become `POST /admin/role` calls with
the admin token, encoder scaling takes standby instances, failures are reported, dry run
calls nothing; the `triptych autoscale` process serves /metrics and /plan."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from stub_router import StubRouter

from triptych.local import StartupError
from triptych.operator.planner.driver import Driver, PlannerMetrics
from triptych.operator.planner.endpoint import PlannerEndpoint
from triptych.operator.planner.local_connector import LocalConnector
from triptych.operator.planner.local_main import LocalPlanner
from triptych.operator.planner.policy_types import PolicyConfig
from triptych.operator.planner.signals import Scraper
from triptych.topology import InstanceType as T

TOKEN = "local-admin-token"
CFG = PolicyConfig(sustain=2, max_queue_per_instance=10, role_switch_cooldown_s=100, encoder_scaling=False)


def inst(iid: str, role: str, load: float = 0, ready: bool = True) -> dict:
    return {"instance_id": iid, "role": role, "load": load, "ready": ready}


@pytest.fixture
def router() -> Iterator[StubRouter]:
    stub = StubRouter(TOKEN, [inst("E-0", "E"), inst("P-0", "P"), inst("D-0", "D", load=5), inst("D-1", "D", load=1),
                              inst("D-2", "D", load=3)], waiting={"P-0": 16})
    yield stub
    stub.close()


class Clock:
    t = 500.0

    def __call__(self) -> float:
        return self.t


def planner(router: StubRouter, cfg: PolicyConfig = CFG, token: str | None = TOKEN) -> tuple[LocalPlanner, Clock]:
    clock = Clock()
    driver = Driver(cfg, metrics=PlannerMetrics(deployment="local"), clock=clock)
    return LocalPlanner(router.url, driver, LocalConnector(router.url, token), Scraper([router.url])), clock


def ticks(p: LocalPlanner, clock: Clock, n: int) -> list:
    out = []
    for _ in range(n):
        out.append(p.tick())
        clock.t += 10
    return out


def test_a_deep_prefill_queue_switches_the_least_loaded_decode_instance(router: StubRouter) -> None:
    p, clock = planner(router)
    ds = ticks(p, clock, 4)
    assert [d.action for d in ds] == ["none", "switch_role", "none", "none"]
    assert router.switched() == [("D-1", "P")]  # D-1 has the least queued work
    assert all(auth == f"Bearer {TOKEN}" for _, auth in router.calls)
    doc = p.driver.document()
    assert doc.counts == {"E": 1, "P": 2, "D": 2} and doc.last_action == ds[1] and doc.actuation_error is None
    assert "role-switch cooldown: 90 s left" in ds[2].reason  # the driver's clock: 10 s after the switch


def test_dry_run_calls_nothing(router: StubRouter) -> None:
    p, clock = planner(router, CFG.model_copy(update={"dry_run": True}))
    ds = ticks(p, clock, 3)
    assert ds[1].action == "switch_role" and ds[1].dry_run
    assert router.calls == [] and p.driver.document().counts == {"E": 1, "P": 1, "D": 3}


def test_a_refused_switch_is_reported(router: StubRouter) -> None:
    router.refuse = True
    p, clock = planner(router)
    ticks(p, clock, 2)
    assert router.switched() == [("D-1", "P")]
    assert "HTTP 409" in (p.driver.document().actuation_error or "")
    assert p.driver.document().counts == {"E": 1, "P": 1, "D": 3}


def test_without_the_admin_token_there_is_no_snapshot_and_no_call(router: StubRouter) -> None:
    p, clock = planner(router, token="wrong")
    assert ticks(p, clock, 3) == [None, None, None]
    assert router.calls == []


ENC = CFG.model_copy(update={"encoder_scaling": True, "divergence_on": 9.0, "scale_up_cooldown_s": 0,
                             "scale_down_cooldown_s": 0, "limits": {T.E: (1, 3)}})


def test_encoder_scaling_takes_a_standby_instance_then_gives_it_back() -> None:
    stub = StubRouter(TOKEN, [inst("E-0", "E", load=30), inst("E-1", "E", load=20), inst("P-0", "P"),
                              inst("D-0", "D"), inst("unassigned-0", "unassigned")])
    try:
        p, clock = planner(stub, ENC)
        ticks(p, clock, 2)  # 25 queued images per E, for 2 snapshots
        assert stub.switched() == [("unassigned-0", "E")]
        for i in stub.instances:
            i["load"] = 0  # the encode queue drains
        stub.instances[0]["load"] = 1
        ticks(p, clock, 2)
        assert stub.switched()[1:] == [("E-1", "unassigned")]  # the least-loaded E leaves
        assert p.driver.document().counts == {"E": 2, "P": 1, "D": 1}
    finally:
        stub.close()


def test_encoder_scale_up_without_a_standby_is_an_error() -> None:
    stub = StubRouter(TOKEN, [inst("E-0", "E", load=30), inst("P-0", "P"), inst("D-0", "D")])
    try:
        p, clock = planner(stub, ENC)
        ticks(p, clock, 2)
        assert stub.calls == []
        assert "standby" in (p.driver.document().actuation_error or "")
    finally:
        stub.close()


class FakeSpawner:
    """The InstanceSpawner's surface (local_spawn.py): a started instance `<type>-a<n>` is
    served by the stub router at `<router>/w/<id>`."""

    def __init__(self, router: StubRouter, fail: str | None = None) -> None:
        self.router, self.fail = router, fail
        self.running: dict[str, str] = {}
        self.stopped: list[str] = []
        self.closed = False

    def start(self, kind: T) -> tuple[str, str]:
        if self.fail:
            raise StartupError(self.fail)
        iid = f"{kind.value}-a{len(self.running) + len(self.stopped)}"
        self.running[iid] = f"{self.router.url}/w/{iid}"
        return iid, self.running[iid]

    def owns(self, instance_id: str) -> bool:
        return instance_id in self.running

    def stop(self, instance_id: str) -> int:
        del self.running[instance_id]
        self.stopped.append(instance_id)
        return 0

    def close(self) -> None:
        self.closed = True


def spawning_planner(stub: StubRouter, spawner: FakeSpawner) -> tuple[LocalPlanner, Clock]:
    clock = Clock()
    driver = Driver(ENC, metrics=PlannerMetrics(deployment="local"), clock=clock)
    conn = LocalConnector(stub.url, TOKEN, spawner=spawner)  # type: ignore[arg-type]
    return LocalPlanner(stub.url, driver, conn, Scraper([stub.url])), clock


def test_encoder_scaling_starts_a_process_past_the_standbys_and_stops_it_first() -> None:
    stub = StubRouter(TOKEN, [inst("E-0", "E", load=30), inst("P-0", "P"), inst("D-0", "D")])
    spawner = FakeSpawner(stub)
    try:
        p, clock = spawning_planner(stub, spawner)
        ticks(p, clock, 2)  # 30 queued images on one E, for 2 snapshots
        assert list(spawner.running) == ["E-a0"] and stub.registered() == [f"{stub.url}/w/E-a0"]
        assert p.driver.document().counts == {"E": 2, "P": 1, "D": 1} and p.driver.document().actuation_error is None
        for i in stub.instances:
            i["load"] = 0  # the encode queue drains; E-0 is the busier one
        stub.instances[0]["load"] = 1
        ticks(p, clock, 2)
        assert stub.deleted() == ["/admin/instances/E-a0"] and spawner.stopped == ["E-a0"]
        assert stub.switched() == []  # the deployment's own E-0 is not parked
        assert all(auth == f"Bearer {TOKEN}" for _, auth in stub.calls)
        p.connector.close()
        assert spawner.closed
    finally:
        stub.close()


def test_a_process_that_does_not_start_is_an_actuation_error() -> None:
    stub = StubRouter(TOKEN, [inst("E-0", "E", load=30), inst("P-0", "P"), inst("D-0", "D")])
    try:
        p, clock = spawning_planner(stub, FakeSpawner(stub, fail="not ready after 180s: worker-E-a0"))
        ticks(p, clock, 2)
        assert stub.calls == []
        assert "starting a E instance failed: not ready after 180s" in (p.driver.document().actuation_error or "")
    finally:
        stub.close()


def test_a_started_process_the_router_refuses_is_stopped() -> None:
    stub = StubRouter(TOKEN, [inst("E-0", "E", load=30), inst("P-0", "P"), inst("D-0", "D")], refuse_register=True)
    spawner = FakeSpawner(stub)
    try:
        p, clock = spawning_planner(stub, spawner)
        ticks(p, clock, 2)
        assert spawner.stopped == ["E-a0"] and not spawner.running
        error = p.driver.document().actuation_error or ""
        assert "the router did not take the new instance E-a0: HTTP 502" in error
    finally:
        stub.close()


def test_video_scaling_unparks_a_standby_v_then_parks_it_again() -> None:
    # a parked V reports `unassigned` with "video": true; the engine standby must not be taken for V
    stub = StubRouter(TOKEN, [inst("E-0", "E"), inst("P-0", "P"), inst("D-0", "D"), inst("V-0", "V"),
                              inst("unassigned-0", "unassigned"), {**inst("V-s1", "unassigned"), "video": True}],
                      video_gop_sets=24)
    try:
        cfg = CFG.model_copy(update={"video_up": 8, "video_down": 1, "scale_up_cooldown_s": 0,
                                     "scale_down_cooldown_s": 0, "divergence_on": 9.0})
        p, clock = planner(stub, cfg)
        ticks(p, clock, 2)  # 24 queued GOP sets on 1 V, for 2 snapshots
        assert stub.switched() == [("V-s1", "V")]
        assert p.driver.document().last_action.rule == "video"
        ticks(p, clock, 2)  # 12 per V: inside the band
        assert len(stub.switched()) == 1
        stub.video_gop_sets = 0  # the video queue drains
        stub.instances[3]["load"] = 2  # V-0 is busier: V-s1 parks
        ticks(p, clock, 2)
        assert stub.switched()[1:] == [("V-s1", "unassigned")]
        assert p.driver.document().counts == {"E": 1, "P": 1, "D": 1, "V": 1}
        assert all(auth == f"Bearer {TOKEN}" for _, auth in stub.calls)
    finally:
        stub.close()


def test_video_scale_up_without_a_video_standby_is_an_error() -> None:
    stub = StubRouter(TOKEN, [inst("E-0", "E"), inst("P-0", "P"), inst("D-0", "D"), inst("V-0", "V"),
                              inst("unassigned-0", "unassigned")], video_gop_sets=40)
    try:
        p, clock = planner(stub, CFG.model_copy(update={"scale_up_cooldown_s": 0, "divergence_on": 9.0}))
        ticks(p, clock, 2)
        assert stub.calls == []  # the engine standby is not a video decoder
        assert "autoscale-video-standby" in (p.driver.document().actuation_error or "")
    finally:
        stub.close()


def test_the_endpoint_serves_metrics_and_the_plan(router: StubRouter) -> None:
    p, clock = planner(router)
    ticks(p, clock, 2)
    endpoint = PlannerEndpoint("127.0.0.1", 0, p.driver.metrics.registry, p.driver.document).start()
    try:
        metrics = httpx.get(f"{endpoint.url}/metrics").text
        assert ('triptych_planner_decisions_total{action="switch_role",deployment="local",dry_run="false",'
                'rule="reactive"} 1.0') in metrics
        assert 'triptych_planner_queued_requests{deployment="local",stage="prefill"} 16.0' in metrics
        doc = httpx.get(f"{endpoint.url}/plan").json()
        assert doc["last_action"]["rule"] == "reactive" and doc["method"] == "E+P+D" and doc["ratio"] == "1:2:2"
        assert httpx.get(f"{endpoint.url}/nothing").status_code == 404
    finally:
        endpoint.stop()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_autoscale_process_acts_and_serves_its_plan(router: StubRouter, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "triptych.cli", "autoscale", "--router", router.url,
                             "--admin-token-file", str(token_file), "--port", str(port), "--interval", "0.2",
                             "--sustain", "2", "--max-queue-per-instance", "10", "--no-encoder-scaling"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 30
        while not router.calls:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no admin call within 30 s"
            time.sleep(0.1)
        assert router.switched() == [("D-1", "P")]
        doc = json.loads(httpx.get(f"http://127.0.0.1:{port}/plan", timeout=5).text)
        assert doc["last_action"]["to_type"] == "P" and doc["counts"]["P"] == 2
        assert "triptych_planner_decisions_total" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0
