"""The operator's planner end to end: kopf + kmock, a REAL Prometheus (Debian's package)
scraping a tiny exporter of recorded router/worker metrics, stub workers recording their
admin calls. Each decision must become admin calls, relabels or replica changes, an Event,
spec.topology and status.plan; a dry run changes nothing but records.
"""

from __future__ import annotations

import contextlib
import http.server
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp.web
import httpx
import kube_harness
import pytest
from kube_harness import Env, operator_grants, rbac_needs, wait_for

from triptych.kube import names
from triptych.operator.planner import k8s_daemon

pytestmark = pytest.mark.timeout(120)
PROMETHEUS = shutil.which("prometheus")

# A deep prefill queue, decode idle: 1E1P2D with 14 requests waiting at the one P.
DEEP_PREFILL = """\
# TYPE triptych_frontend_instance_ready gauge
triptych_frontend_instance_ready{instance="e-0",role="E"} 1
triptych_frontend_instance_ready{instance="p-0",role="P"} 1
triptych_frontend_instance_ready{instance="d-0",role="D"} 1
triptych_frontend_instance_ready{instance="d-1",role="D"} 1
# TYPE triptych_worker_requests gauge
triptych_worker_requests{instance="p-0",role="P",state="waiting"} 14
triptych_worker_requests{instance="d-0",role="D",state="waiting"} 0
triptych_worker_requests{instance="d-1",role="D",state="waiting"} 0
triptych_worker_requests{instance="e-0",role="E",state="waiting"} 0
"""

# A deep encode queue (images queued at the E instance), no request queue anywhere.
DEEP_ENCODE = """\
# TYPE triptych_frontend_instance_ready gauge
triptych_frontend_instance_ready{instance="e-0",role="E"} 1
triptych_frontend_instance_ready{instance="p-0",role="P"} 1
triptych_frontend_instance_ready{instance="d-0",role="D"} 1
# TYPE triptych_frontend_instance_load gauge
triptych_frontend_instance_load{instance="e-0",role="E"} 24
triptych_frontend_instance_load{instance="p-0",role="P"} 0
"""

# GOP sets queued for the V instances (the router's gauge): 40 over 1 V.
DEEP_VIDEO = """\
# TYPE triptych_frontend_instance_ready gauge
triptych_frontend_instance_ready{instance="e-0",role="E"} 1
triptych_frontend_instance_ready{instance="p-0",role="P"} 1
triptych_frontend_instance_ready{instance="d-0",role="D"} 1
triptych_frontend_instance_ready{instance="v-0",role="V"} 1
# TYPE triptych_frontend_video_queued_gop_sets gauge
triptych_frontend_video_queued_gop_sets 40
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def exporter(text: str | Callable[[], str]) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (text() if callable(text) else text).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def prometheus(target: str, tmp: Path) -> Iterator[str]:
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary (apt-get install -y prometheus; tools/install-test-deps.sh)")
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: triptych, static_configs: [{{targets: ['{target}']}}]}}]\n")
    port = _free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # ready, and the exporter scraped at least once
            try:
                r = httpx.get(f"{url}/api/v1/query", params={"query": "up"}, timeout=1)
                if r.status_code == 200 and r.json()["data"]["result"]:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, "prometheus did not scrape the exporter within 30 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def admin_headers(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:

    """The Authorization header of every /admin/role call the stub workers receive; planner
    settings with a short PromQL window and the operator's planner endpoint on a free port
    (the admin token comes from the deployment's tokens Secret, as in a cluster)."""
    seen: list[str | None] = []
    original = kube_harness.FakeWorker._set_role

    async def recording(self: kube_harness.FakeWorker, request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(request.headers.get("Authorization"))
        return await original(self, request)

    monkeypatch.setattr(kube_harness.FakeWorker, "_set_role", recording)
    monkeypatch.setattr(k8s_daemon, "SETTINGS", k8s_daemon.PlannerSettings(
        promql_window="5s", endpoint=f"127.0.0.1:{_free_port()}"))
    return seen


def spec(port: int, prom: str, topology: dict[str, int], **auto: Any) -> dict[str, Any]:
    video = [{"name": "dec", "instanceTypes": ["V"], "port": port}] if topology.get("V") else []
    return {
        "model": {"source": {"tiny": "qwen2-vl"}, "dtype": "float32"},
        "topology": topology,
        "pools": [{"name": "cpu", "port": port}, *video],
        "autoscaling": {"enabled": True, "prometheusUrl": prom, "intervalSeconds": 1, "sustain": 2,
                        "roleSwitchCooldownSeconds": 600, "scaleUpCooldownSeconds": 600,
                        "scaleDownCooldownSeconds": 600, **auto},
    }


def roles(env: Env) -> dict[str, str | None]:
    return {n: p["metadata"]["labels"].get(names.LABEL_ROLE) for n, p in env.cluster.pods().items()}


async def start(env: Env, prom: str, topology: dict[str, int], **auto: Any) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, prom, topology, **auto))
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu"), what="worker deployment")
    await env.cluster.reconcile_replicas()
    await wait_for(lambda: all(roles(env).values()), what="every pod labelled with a role")


def plan(env: Env) -> dict[str, Any]:
    return ((env.cluster.mllm("demo") or {}).get("status") or {}).get("plan") or {}


def events(env: Env, reason: str) -> list[str]:
    return [m for op in env.operators for _, r, m in op.events if r == reason]


def assert_within_the_cluster_role(env: Env) -> None:
    """Every request the operator made, its planner's included (the tokens Secret, pod
    relabels, replicas, the spec's topology, status.plan, Events, the profile ConfigMap),
    is one deploy/operator-rbac.yaml grants: a planner needing more would fail in a cluster."""
    assert rbac_needs(env.api) - operator_grants() == set(), "requests the ClusterRole does not allow"


async def test_a_deep_prefill_queue_switches_one_decode_pod_to_prefill(env: Env, tmp_path: Path,
                                                                       admin_headers: list) -> None:
    with exporter(DEEP_PREFILL) as target, prometheus(target, tmp_path) as prom:
        await start(env, prom, {"E": 1, "P": 1, "D": 2})
        assert sorted(roles(env).values()) == ["D", "D", "E", "P"]
        before = {n: list(w.calls) for n, w in env.cluster.workers.items()}
        await wait_for(lambda: events(env, "PlannerRoleSwitch"), timeout=60, what="the planner's role switch")
    switched = [n for n, w in env.cluster.workers.items() if w.calls != before[n]]
    assert len(switched) == 1
    pod = switched[0]
    assert env.cluster.workers[pod].calls == ["D", "P"]  # assigned D by reconcile, then switched by the planner
    assert admin_headers[-1] == f"Bearer {env.cluster.admin_token('demo')}"
    assert roles(env)[pod] == "P"
    assert env.cluster.pods()[pod]["metadata"]["labels"][names.LABEL_LLMD_ROLE] == "prefill"
    mllm = env.cluster.mllm("demo")
    assert {k: v for k, v in mllm["spec"]["topology"].items() if v} == {"E": 1, "P": 2, "D": 1}
    assert env.api.get("apps/v1/deployments", "demo-cpu")["spec"]["replicas"] == 4  # a switch, not a scale
    message = events(env, "PlannerRoleSwitch")[0]
    assert "switch one D to P" in message and pod in message and "reactive" in message
    await wait_for(lambda: plan(env).get("last_action"), what="status.plan")
    doc = plan(env)
    assert doc["last_action"]["rule"] == "reactive" and doc["last_action"]["to_type"] == "P"
    assert doc["counts"] == {"E": 1, "P": 2, "D": 1} and doc["dry_run"] is False
    assert doc.get("observed_attainment") is None  # the recording has no SLO counters (null: key dropped)
    endpoint = f"http://{k8s_daemon.SETTINGS.endpoint}"  # the operator's /metrics and /plan
    metrics = httpx.get(f"{endpoint}/metrics", timeout=5).text
    assert ('triptych_planner_decisions_total{action="switch_role",deployment="serving/demo",dry_run="false",'
            'rule="reactive"} 1.0') in metrics
    assert 'triptych_planner_queued_requests{deployment="serving/demo",stage="prefill"} 14.0' in metrics
    served = httpx.get(f"{endpoint}/plan", timeout=5).json()
    assert served["serving/demo"]["last_action"]["to_type"] == "P"
    # reconcile passes (timer 0.5 s) agree with the planner: nothing switches back
    calls = {n: list(w.calls) for n, w in env.cluster.workers.items()}
    await env.cluster.reconcile_replicas()
    await wait_for(lambda: (env.cluster.mllm("demo")["status"].get("topology") == "1E2P1D"), what="status topology")
    await _settle(1.5)
    assert {n: w.calls for n, w in env.cluster.workers.items()} == calls
    assert sorted(roles(env).values()) == ["D", "E", "P", "P"]
    assert_within_the_cluster_role(env)


async def test_dry_run_records_the_decision_and_changes_nothing(env: Env, tmp_path: Path,
                                                                admin_headers: list) -> None:
    with exporter(DEEP_PREFILL) as target, prometheus(target, tmp_path) as prom:
        await start(env, prom, {"E": 1, "P": 1, "D": 2}, dryRun=True)
        calls = {n: list(w.calls) for n, w in env.cluster.workers.items()}
        await wait_for(lambda: events(env, "PlannerDryRun"), timeout=60, what="a dry-run decision")
        await wait_for(lambda: (plan(env).get("last_action") or {}).get("dry_run"), what="status.plan")
    assert "would switch one D to P" in events(env, "PlannerDryRun")[0]
    assert {n: w.calls for n, w in env.cluster.workers.items()} == calls
    assert env.cluster.mllm("demo")["spec"]["topology"] == {"E": 1, "P": 1, "D": 2}
    assert sorted(roles(env).values()) == ["D", "D", "E", "P"]
    assert not events(env, "PlannerRoleSwitch")
    assert plan(env)["dry_run"] is True and plan(env)["counts"] == {"E": 1, "P": 1, "D": 2}


async def test_a_refused_switch_is_a_warning_and_the_topology_stays(env: Env, tmp_path: Path,
                                                                     admin_headers: list) -> None:
    with exporter(DEEP_PREFILL) as target, prometheus(target, tmp_path) as prom:
        await start(env, prom, {"E": 1, "P": 1, "D": 2})
        for worker in env.cluster.workers.values():
            worker.refuse = True
        await wait_for(lambda: events(env, "PlannerActionFailed"), timeout=60, what="the failed switch")
        await wait_for(lambda: plan(env).get("actuation_error"), what="status.plan's error")
    assert "HTTP 503" in events(env, "PlannerActionFailed")[0]
    assert "HTTP 503" in plan(env)["actuation_error"]
    assert env.cluster.mllm("demo")["spec"]["topology"] == {"E": 1, "P": 1, "D": 2}
    assert sorted(roles(env).values()) == ["D", "D", "E", "P"]
    assert plan(env)["counts"] == {"E": 1, "P": 1, "D": 2}


async def test_a_deep_encode_queue_adds_an_encoder_pod(env: Env, tmp_path: Path, admin_headers: list) -> None:
    with exporter(DEEP_ENCODE) as target, prometheus(target, tmp_path) as prom:
        await start(env, prom, {"E": 1, "P": 1, "D": 1}, limits={"E": {"min": 1, "max": 3}})
        await wait_for(lambda: events(env, "PlannerScale"), timeout=60, what="the planner's scale-up")
    assert "scale E by +1" in events(env, "PlannerScale")[0]
    assert env.api.get("apps/v1/deployments", "demo-cpu")["spec"]["replicas"] == 4
    assert {k: v for k, v in env.cluster.mllm("demo")["spec"]["topology"].items() if v} == {"E": 2, "P": 1, "D": 1}
    await env.cluster.reconcile_replicas()  # the ReplicaSet creates the pod; reconcile gives it the E role
    await wait_for(lambda: sorted(r for r in roles(env).values() if r) == ["D", "E", "E", "P"],
                   what="the new pod serving E")
    assert plan(env)["last_action"]["rule"] == "encoder"
    assert_within_the_cluster_role(env)


async def test_a_deep_video_queue_adds_a_v_pod(env: Env, tmp_path: Path, admin_headers: list) -> None:
    with exporter(DEEP_VIDEO) as target, prometheus(target, tmp_path) as prom:
        await start(env, prom, {"E": 1, "P": 1, "D": 1, "V": 1}, limits={"V": {"min": 1, "max": 2}},
                    encoderScaling=False)
        await wait_for(lambda: events(env, "PlannerScale"), timeout=60, what="the planner's V scale-up")
    assert "scale V by +1" in events(env, "PlannerScale")[0]
    # the V pool's Deployment grows; the model pool's does not
    assert env.api.get("apps/v1/deployments", "demo-dec")["spec"]["replicas"] == 2
    assert env.api.get("apps/v1/deployments", "demo-cpu")["spec"]["replicas"] == 3
    topo = {k: v for k, v in env.cluster.mllm("demo")["spec"]["topology"].items() if v}
    assert topo == {"E": 1, "P": 1, "D": 1, "V": 2}
    await env.cluster.reconcile_replicas()  # the ReplicaSet creates the pod; reconcile gives it role V
    await wait_for(lambda: sorted(r for r in roles(env).values() if r) == ["D", "E", "P", "V", "V"],
                   what="the new pod serving V")
    assert plan(env)["last_action"]["rule"] == "video" and plan(env)["counts"]["V"] == 2


def steady_traffic(started: float = time.time()) -> str:
    """A router serving 4 requests/s of 1 image, 600 prompt and 64 output tokens each: the
    counters a replan reads its workload window from (operator/planner/signals.py)."""
    t = time.time() - started
    return DEEP_PREFILL + "".join(f"# TYPE {name} counter\n{name}{{model=\"demo\"}} {4 * t * per:.1f}\n" for name, per in (
        ("triptych_frontend_e2e_request_latency_seconds_count", 1), ("triptych_frontend_images_total", 1),
        ("triptych_frontend_prompt_tokens_total", 600), ("triptych_frontend_generation_tokens_total", 64)))


async def test_replans_run_on_the_roofline_of_the_profile_config_map(env: Env, tmp_path: Path,
                                                                      admin_headers: list) -> None:
    """spec.autoscaling.replanProfile: the model's config.json in a ConfigMap and a GPU; the
    daemon replans on the workload window (status.plan's replanned_at, predicted attainment,
    the proposal; the operator's predicted-goodput gauge). Before the ConfigMap exists the
    planner says why it does not replan (a Warning Event) and keeps deciding."""
    from triptych.tiny_model import tiny_model_path

    config = (tiny_model_path("qwen2-vl") / "config.json").read_text()
    with exporter(lambda: steady_traffic()) as target, prometheus(target, tmp_path) as prom:
        await start(env, prom, {"E": 1, "P": 1, "D": 2}, dryRun=True, replanIntervalSeconds=10,
                    replanProfile={"configMap": "demo-profile", "gpu": "H100"})
        await wait_for(lambda: events(env, "PlannerProfileError"), timeout=60, what="the missing ConfigMap")
        assert "ConfigMap serving/demo-profile not found" in events(env, "PlannerProfileError")[0]
        await env.cluster.request("POST", f"/api/v1/namespaces/{kube_harness.NS}/configmaps", {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "demo-profile", "namespace": kube_harness.NS},
            "data": {"config.json": config}})
        await wait_for(lambda: plan(env).get("replanned_at") and plan(env).get("proposal"), timeout=90,
                       what="a replan in status.plan")
    doc = plan(env)
    assert doc["predicted_attainment"] is not None and 0 <= doc["predicted_attainment"] <= 1
    assert doc["proposal"]["method"] in ("E+P+D", "EP+D", "ED+P", "E+PD", "EPD")
    assert sum(doc["proposal"]["counts"].values()) == 4  # the instances it has, re-planned
    assert len(events(env, "PlannerProfileError")) == 1  # said once, not every tick
    metrics = httpx.get(f"http://{k8s_daemon.SETTINGS.endpoint}/metrics", timeout=5).text
    assert 'triptych_planner_predicted_goodput_rps{deployment="serving/demo"}' in metrics
    assert_within_the_cluster_role(env)


async def _settle(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
