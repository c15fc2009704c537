"""Shared-GPU co-location (UnifiedServe §4; operator/shared_gpu.py): a pool option renders
pods that run an EP worker and a D worker on one GPU under NVIDIA MPS, the EP worker with
the encode and prefill token budgets (Alg. 3), and the router's discovery sees both."""

from __future__ import annotations

from typing import Any

import aiohttp
import kubernetes_validate
import pytest
from kube_harness import NS, TEST_AGENT, Cluster, FakeWorker, api_server, free_port, wait_for

from triptych.cli import build_parser
from triptych.kube import names
from triptych.kube.client import KubeClient, Login
from triptych.operator.api import InvalidSpecError, parse_spec
from triptych.operator.desired import ClusterFacts, Owner, desired_objects
from triptych.operator.roles import WorkerPod
from triptych.operator.status import Observation, _serving_status
from triptych.router.k8s_discovery import KubernetesDiscovery, WorkerEndpoint
from triptych.topology import InstanceType
from triptych.worker.settings import settings_from_args

OWNER = Owner(name="demo", namespace="serving", uid="6d0c0a7e-0000-4000-8000-000000000001")
FACTS = ClusterFacts(service_monitor_crd=False, operator_namespace="triptych-system")
GPU = {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1},
       "limits": {"memory": "16Gi", "nvidia.com/gpu": 1}}


def _pool(**shared: Any) -> dict[str, Any]:
    return {"name": "shared", "instanceTypes": ["EP", "D"], "resources": GPU,
            "sharedGpu": {"encodeTokenBudget": 1024, "prefillTokenBudget": 256, **shared}}


def _spec(topology: dict[str, int] | None = None, pool: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"model": {"source": {"tiny": "qwen2-vl"}}, "topology": topology or {"EP": 2, "D": 2},
            "pools": [pool or _pool(encodePrefillThreadPercentage=60, decodeThreadPercentage=40)]}


def _deployment(spec: dict[str, Any]) -> dict[str, Any]:
    return desired_objects(OWNER, parse_spec(spec, name=OWNER.name), FACTS).by_kind("Deployment")["demo-shared"]


def _env(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container["env"]}


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_pod_runs_ep_and_d_workers_under_mps() -> None:
    dep = _deployment(_spec())
    assert dep["spec"]["replicas"] == 2  # one pod per EP + D pair
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["annotations"][names.ANNOTATION_WORKERS] == "EP=8100,D=8101"
    pod = tmpl["spec"]
    ep, d = pod["containers"]
    assert (ep["name"], d["name"]) == ("worker", "worker-decode")
    assert (_flag(ep["args"], "--role"), _flag(d["args"], "--role")) == ("EP", "D")
    assert (_flag(ep["args"], "--port"), _flag(d["args"], "--port")) == ("8100", "8101")
    assert ep["ports"] == [{"name": "http", "containerPort": 8100, "protocol": "TCP"}]
    assert d["ports"] == [{"name": "http-decode", "containerPort": 8101, "protocol": "TCP"}]
    assert d["readinessProbe"]["httpGet"]["port"] == "http-decode"
    assert _flag(ep["args"], "--instance-id") != _flag(d["args"], "--instance-id")
    # Alg. 3's budgets bound the EP instance's iterations; the D instance has none.
    assert (_flag(ep["args"], "--encode-token-budget"), _flag(ep["args"], "--token-budget")) == ("1024", "256")
    assert "--token-budget" not in d["args"] and "--encode-token-budget" not in d["args"]
    # One GPU, requested by one container; the others see it through the toolkit.
    assert ep["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in d["resources"].get("limits", {})
    mps = {c["name"]: c for c in pod["initContainers"]}["mps-control"]
    assert mps["restartPolicy"] == "Always" and mps["command"] == ["nvidia-cuda-mps-control", "-f"]
    for c in (ep, d, mps):
        env = _env(c)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == names.MPS_PIPE_DIR
        assert env["CUDA_MPS_LOG_DIRECTORY"] == names.MPS_LOG_DIR
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {names.MPS_PIPE_DIR, names.MPS_LOG_DIR}
    assert (_env(ep)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], _env(d)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == ("60", "40")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in _env(mps)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["mps-pipe"]["emptyDir"]["medium"] == "Memory" and "emptyDir" in vols["mps-log"]
    for version in ("1.33", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(dep, version, strict=True)


def test_thread_percentages_are_optional_and_mps_image_overrides() -> None:
    dep = _deployment(_spec(pool=_pool(mpsImage="nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04", decodePort=9000)))
    pod = dep["spec"]["template"]["spec"]
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in _env(c) for c in pod["containers"])
    assert pod["initContainers"][-1]["image"] == "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
    assert _flag(pod["containers"][1]["args"], "--port") == "9000"


def test_rendered_args_reach_the_worker_settings() -> None:
    ep, d = _deployment(_spec())["spec"]["template"]["spec"]["containers"]
    s_ep = settings_from_args(build_parser().parse_args(["worker", *ep["args"], "--config", ""]))
    s_d = settings_from_args(build_parser().parse_args(["worker", *d["args"], "--config", ""]))
    assert (s_ep.role, s_ep.token_budget, s_ep.encode_token_budget, s_ep.device) == ("EP", 256, 1024, "cuda")
    assert (s_d.role, s_d.token_budget, s_d.encode_token_budget, s_d.device) == ("D", None, None, "cuda")


def test_network_policy_service_and_monitor_cover_the_decode_port() -> None:
    facts = ClusterFacts(service_monitor_crd=True, operator_namespace="triptych-system")
    desired = desired_objects(OWNER, parse_spec(_spec(), name=OWNER.name), facts)
    (policy,) = desired.by_kind("NetworkPolicy").values()
    ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])]
    assert "http-decode" in ports
    service = desired.by_kind("Service")["demo-workers"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http", "http-decode"]
    (monitor,) = desired.by_kind("ServiceMonitor").values()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "http-decode"]
    for obj in (policy, service):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    plain = desired_objects(OWNER, parse_spec({**_spec(), "pools": []}, name=OWNER.name), facts)
    assert [p["targetPort"] for p in plain.by_kind("Service")["demo-workers"]["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize(("spec", "problem"), [
    (_spec({"EP": 2, "D": 1}), "pairs"),
    (_spec(pool={**_pool(), "instanceTypes": ["EP", "D", "P"]}), "instanceTypes must be [EP, D]"),
    (_spec(pool=_pool(decodePort=8100)), "must differ"),
    (_spec(pool={**_pool(), "resources": {"requests": {"cpu": "1"}}}), "needs nvidia.com/gpu"),
])
def test_invalid_shared_gpu_specs(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(InvalidSpecError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_spec(spec, name="demo")


def test_desired_roles_and_status_count_both_workers() -> None:
    desired = desired_objects(OWNER, parse_spec(_spec(), name=OWNER.name), FACTS)
    assert desired.pool_counts["shared"] == {InstanceType.EP: 2, InstanceType.D: 2}
    assert desired.role_counts("shared") == {InstanceType.EP: 2}  # the planner labels the pods EP
    pods = [WorkerPod(f"demo-shared-{i}", InstanceType.EP, ready=True, ip=f"10.0.0.{i}") for i in (1, 2)]
    status, conditions = _serving_status(Observation(1, desired.pool_counts, {"shared": pods}, router_ready=1,
                                                     colocated=desired.colocated))
    assert status["instances"] == "4/4"
    assert {c["type"]: c["status"] for c in conditions}["Ready"] == "True"


def _shared_pod(name: str, ip: str, ep_port: int, d_port: int) -> dict[str, Any]:
    labels = {**names.worker_selector("demo"), names.LABEL_ROLE: "EP"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels,
                         "annotations": {names.ANNOTATION_WORKERS: f"EP={ep_port},D={d_port}"}},
            "spec": {"containers": [
                {"name": "worker", "ports": [{"name": names.PORT_NAME, "containerPort": ep_port}]},
                {"name": "worker-decode", "ports": [{"name": names.DECODE_PORT_NAME, "containerPort": d_port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.timeout(60)
async def test_discovery_sees_both_workers_of_a_shared_gpu_pod() -> None:
    ep_port, d_port = free_port(), free_port()
    async with api_server() as (api, url), aiohttp.ClientSession(
            base_url=url, headers={"User-Agent": TEST_AGENT}) as client:
        cluster = Cluster(api, client, ep_port)
        ep, d = FakeWorker("127.0.0.2", ep_port, role="EP"), FakeWorker("127.0.0.2", d_port, role="D")
        for w in (ep, d):
            await w.start()
        kube = KubeClient(lambda: Login(server=url))
        try:
            await cluster.request("POST", f"/api/v1/namespaces/{NS}/pods",
                                  _shared_pod("demo-shared-1", "127.0.0.2", ep_port, d_port))
            discovery = KubernetesDiscovery(NS, "demo", kube=kube, health_interval=0.2)
            async with discovery:
                await discovery.wait_synced(10)
                both = sorted([WorkerEndpoint(f"http://127.0.0.2:{ep_port}", "EP", "demo-shared-1"),
                               WorkerEndpoint(f"http://127.0.0.2:{d_port}", "D", "demo-shared-1")],
                              key=lambda e: e.url)
                await wait_for(lambda: discovery.current() == both, what="both workers of the pod")
                d.role = "unassigned"  # the D container restarted: only it drops out
                await wait_for(lambda: [e.role for e in discovery.current()] == ["EP"], what="D dropped")
                await cluster.request("DELETE", f"/api/v1/namespaces/{NS}/pods/demo-shared-1")
                await wait_for(lambda: discovery.current() == [], what="pod gone")
        finally:
            await kube.aclose()
            for w in (ep, d):
                await w.stop()
