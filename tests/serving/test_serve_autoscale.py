"""`triptych serve --autoscale`: the planner runs as its own process beside the deployment,
reads the real router's admin view and /metrics, serves /plan and /metrics, and stops with
`serve`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest
import servekit

from triptych.local import free_port
from triptych.local_spawn import SpawnSpec

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
        # the planner gets how to start more instances like these, owner-only (it holds the tokens)
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in children]
        (planner_cmd,) = [c for c in cmdlines if "autoscale" in c]
        spec_file = Path(planner_cmd[planner_cmd.index("--spawn-spec") + 1])
        assert stat.S_IMODE(spec_file.stat().st_mode) == 0o600
        spec = SpawnSpec.read(spec_file)
        assert spec.model.endswith("qwen2-vl-tiny-s0") and spec.admin_token and spec.internal_token
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
        assert not spec_file.exists()


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


def test_the_local_connector_starts_an_encoder_process_and_stops_it_without_losing_a_request(
        qwen2_vl_dir: Path, tmp_path: Path) -> None:
    """No standby: scaling E up starts an instance process like the deployment's own
    (local_spawn.py) and registers it with the router, which routes encodes to it; scaling
    down forgets it at the router and stops it (SIGTERM, the worker drains) while requests are
    in flight. Every completion is greedy-exact, nothing leaks, the process exits on its own."""
    from triptych.local_spawn import InstanceSpawner, SpawnSpec
    from triptych.operator.planner.local_connector import LocalConnector
    from triptych.topology import InstanceType as T

    cases = servekit.make_cases(8, max_tokens=6)
    expected = [servekit.expected_ids(qwen2_vl_dir, c) for c in cases]
    bodies = [c.openai_body(qwen2_vl_dir.name) for c in cases]
    dep = servekit.start(qwen2_vl_dir, "1E1P1D", tmp_path)
    conn = LocalConnector(dep.router_url, dep.admin_token, spawner=InstanceSpawner(SpawnSpec.of(dep)))
    try:
        conn.set_replicas(T.E, 2)
        assert conn.counts() == {T.E: 2, T.P: 1, T.D: 1}
        (started,) = conn.spawner.running.values()
        assert {i["instance_id"]: i["url"] for i in conn.instances()}["E-a0"] == started.url
        conn.switch_role("E-0", T.P)  # for a while only the started process encodes
        results = asyncio.run(servekit.run_all(dep.router_url, bodies))
        assert [r.get("token_ids") for r in results] == expected, [r.get("error") for r in results]
        stats = httpx.get(f"{started.url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        assert stats["counters"]["images_encoded"] == sum(len(c.images) for c in cases)
        conn.switch_role("E-0", T.E)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # scale down under load
            running = pool.submit(lambda: asyncio.run(servekit.run_all(dep.router_url, bodies)))
            time.sleep(0.3)
            conn.set_replicas(T.E, 1)
            results = running.result(timeout=180)
        assert [r.get("token_ids") for r in results] == expected, [r.get("error") for r in results]
        # it exited on its SIGTERM after draining (uvicorn re-raises the signal), not killed
        assert started.popen.returncode == -signal.SIGTERM and not conn.spawner.running
        assert "E-a0" not in {i["instance_id"] for i in conn.instances()}
        assert conn.counts() == {T.E: 1, T.P: 1, T.D: 1}
        servekit.assert_no_leaks(servekit.wait_idle(dep))
    finally:
        conn.close()
        dep.stop()
