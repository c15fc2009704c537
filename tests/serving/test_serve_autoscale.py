"""`triptych serve --autoscale`: the planner runs as its own process beside the deployment,
reads the real router's admin view and /metrics, serves /plan and /metrics, and stops with
`serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from triptych.local import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_autoscale_runs_the_planner_on_the_real_router() -> None:
    port, planner_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "triptych.cli", "serve", "--model", "tiny", "--topology",
                             "1E1P1D", "--port", str(port), "--autoscale", "--planner-port", str(planner_port),
                             "--autoscale-standby", "1", "--autoscale-args", "--dry-run --interval 0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "planner:" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited before starting the planner"
        assert f"http://127.0.0.1:{planner_port}/plan" in line
        children = _children(proc.pid)
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_parked_v_standby_scales_v_through_the_local_connector() -> None:
    """`--autoscale-video-standby 1`: a V process started parked (the router lists it
    `unassigned` + video, the planner does not count it); the local connector's V scale-up
    un-parks it (the router then routes video to two V), scale-down parks one again."""
    from triptych.operator.planner.local_connector import LocalConnector
    from triptych.topology import InstanceType

    port, planner_port = free_port(), free_port()
    token = "test-admin-token-v-standby"
    proc = subprocess.Popen([sys.executable, "-m", "triptych.cli", "serve", "--model", "tiny", "--topology",
                             "1V1E1P1D", "--port", str(port), "--autoscale", "--planner-port", str(planner_port),
                             "--autoscale-video-standby", "1", "--autoscale-args", "--dry-run --interval 0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TRIPTYCH_ADMIN_TOKEN": token})
    router = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "planner:" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited before starting the planner"
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
