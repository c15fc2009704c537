"""`triptych serve --autoscale`: the planner runs as its own process beside the deployment,
reads the real router's admin view and /metrics, serves /plan and /metrics, and stops with
`serve`."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import servekit

from triptych.local import free_port

pytestmark = pytest.mark.slow


def test_serve_autoscale_runs_the_planner_on_the_real_router() -> None:
    port, planner_port = free_port(), free_port()
    with servekit.serve_cli(port, "1E1P1D", "--autoscale", "--planner-port", str(planner_port),
                            "--autoscale-standby", "1", "--autoscale-args", "--dry-run --interval 0.5") as proc:
        deadline = time.monotonic() + 240
        line = servekit.wait_for_line(proc, "planner:")
        assert f"http://127.0.0.1:{planner_port}/plan" in line
        children = servekit.children(proc.pid)
        assert len(children) == 6  # three instances, one standby, the router, the planner
        plan: dict = {}
        while not plan.get("decisions") and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                plan = httpx.get(f"http://127.0.0.1:{planner_port}/plan", timeout=5).json()
            except httpx.HTTPError:
                pass
        assert plan["counts"] == {"E": 1, "P": 1, "D": 1}  # the standby holds no role
        assert plan["dry_run"] is True and plan["method"] == "E+P+D"
        assert plan["snapshot"]["queues"]["encode"]["instances"] == 1
        metrics = httpx.get(f"http://127.0.0.1:{planner_port}/metrics", timeout=5).text
        assert 'triptych_planner_stage_instances{deployment="local",stage="decode"} 1.0' in metrics
        servekit.stop_cleanly(proc, children)


def test_a_parked_v_standby_scales_v_through_the_local_connector() -> None:
    """`--autoscale-video-standby 1`: a V process started parked (the router lists it
    `unassigned` + video, the planner does not count it); the local connector's V scale-up
    un-parks it (the router then routes video to two V), scale-down parks one again."""
    from triptych.operator.planner.local_connector import LocalConnector
    from triptych.topology import InstanceType

    port, planner_port = free_port(), free_port()
    token = "test-admin-token-v-standby"
    router = f"http://127.0.0.1:{port}"
    with servekit.serve_cli(port, "1V1E1P1D", "--autoscale", "--planner-port", str(planner_port),
                            "--autoscale-video-standby", "1", "--autoscale-args", "--dry-run --interval 0.5",
                            env={**os.environ, "TRIPTYCH_ADMIN_TOKEN": token}) as proc:
        servekit.wait_for_line(proc, "planner:")
        conn = LocalConnector(router, token)
        try:
            roles = {i["instance_id"]: (i["role"], i.get("video")) for i in conn.instances()}
            assert roles["V-s0"] == ("unassigned", True) and roles["V-0"] == ("V", True)
            assert conn.counts() == {InstanceType.V: 1, InstanceType.E: 1, InstanceType.P: 1, InstanceType.D: 1}
            conn.set_replicas(InstanceType.V, 2)
            assert conn.counts()[InstanceType.V] == 2
            assert httpx.get(f"{router}/health", timeout=5).json()["stages"]["video_decode"] == 2
            conn.set_replicas(InstanceType.V, 1)
            roles = {i["instance_id"]: i["role"] for i in conn.instances()}
            assert sorted(r for r in roles.values() if r in ("V", "unassigned")) == ["V", "unassigned"]
            assert httpx.get(f"{router}/health", timeout=5).json()["stages"]["video_decode"] == 1
        finally:
            conn.close()
        servekit.stop_cleanly(proc)
