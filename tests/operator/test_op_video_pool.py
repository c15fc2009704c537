"""V (video decoder) instances on Kubernetes: the CRD's topology and pools take V, the
operator renders V pods in a pool of their own (started `--role V`, CPU only, the model
directory mounted read-only for the processor config), refuses V in a mixed pool, and
assigns V to V pods like any role."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from triptych.operator.api import InvalidSpecError, parse_spec
from triptych.operator.crd import build_crd
from triptych.operator.desired import ClusterFacts, Owner, desired_objects
from triptych.operator.roles import WorkerPod, plan_pool
from triptych.topology import InstanceType

OWNER = Owner(name="demo", namespace="serving", uid="6d0c0a7e-0000-4000-8000-000000000001")
FACTS = ClusterFacts(service_monitor_crd=False, operator_namespace="triptych-system")


def _spec(topology: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"model": {"source": {"tiny": "qwen2-vl"}, "dtype": "float32"}, "topology": topology, **extra}


def _deployments(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return desired_objects(OWNER, parse_spec(spec, name=OWNER.name), FACTS).by_kind("Deployment")


def _args(dep: dict[str, Any]) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_crd_topology_and_pools_take_v() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "V" in schema["topology"]["properties"]
    assert "V" in schema["pools"]["items"]["properties"]["instanceTypes"]["items"]["enum"]


def test_default_pools_put_v_pods_in_their_own_cpu_deployment() -> None:
    deps = _deployments(_spec({"V": 2, "E": 1, "P": 1, "D": 1}))
    workers, video = deps["demo-workers"], deps["demo-video"]
    assert workers["spec"]["replicas"] == 3 and video["spec"]["replicas"] == 2
    args = _args(video)
    assert args[args.index("--role") + 1] == "V" and args[args.index("--device") + 1] == "cpu"
    assert _args(workers)[_args(workers).index("--role") + 1] == "unassigned"
    container = video["spec"]["template"]["spec"]["containers"][0]
    assert not any("gpu" in k for k in container["resources"].get("limits", {}))
    # The processor config comes from the model directory: mounted read-only, nothing else.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True
    for version in ("1.33", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(video, version, strict=True)


def test_no_v_no_video_deployment() -> None:
    assert set(_deployments(_spec({"E": 1, "P": 1, "D": 1}))) == {"demo-workers", "demo-router"}


def test_explicit_video_pool() -> None:
    pools = [{"name": "gpu", "instanceTypes": ["E", "P", "D"]}, {"name": "dec", "instanceTypes": ["V"]}]
    deps = _deployments(_spec({"V": 3, "E": 1, "P": 1, "D": 1}, pools=pools))
    assert deps["demo-dec"]["spec"]["replicas"] == 3 and deps["demo-gpu"]["spec"]["replicas"] == 3


@pytest.mark.parametrize("pools", [[{"name": "all", "instanceTypes": ["V", "E", "P", "D"]}],
                                   [{"name": "a", "instanceTypes": ["E", "P", "D"]}]])
def test_v_needs_a_pool_of_its_own(pools: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidSpecError, match="V"):
        parse_spec(_spec({"V": 1, "E": 1, "P": 1, "D": 1}, pools=pools), name="demo")


def test_v_without_an_encoder_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match="encode"):
        parse_spec(_spec({"V": 1, "P": 1, "D": 1}), name="demo")


def test_v_pods_get_role_v() -> None:
    pods = [WorkerPod(name=f"v-0{i}", role=None, ready=True, ip=f"10.0.0.{i}", created=f"2026-01-01T00:00:0{i}Z")
            for i in (1, 2)]
    plan = plan_pool({InstanceType.V: 2}, pods)
    assert sorted((c.pod, c.new) for c in plan.changes) == [("v-01", InstanceType.V), ("v-02", InstanceType.V)]
    settled = [WorkerPod(name=p.name, role=InstanceType.V, ready=True, ip=p.ip, created=p.created) for p in pods]
    assert plan_pool({InstanceType.V: 2}, settled).settled


async def test_operator_labels_v_pods_and_reports_them_ready(env) -> None:
    """Real kopf against the fake cluster: the V pool's pods get role V (the worker accepts V
    on /admin/role, or already serves it), are labelled, and count as ready V instances."""
    from kube_harness import wait_for
    from test_op_integration import settle

    from triptych.kube import names

    port = env.cluster.worker_port
    env.start_operator()
    pools = [{"name": "cpu", "port": port}, {"name": "dec", "instanceTypes": ["V"], "port": port}]
    await env.cluster.create_mllm("demo", _spec({"V": 2, "E": 1, "P": 1, "D": 1}, pools=pools))
    await settle(env, "demo", 5)
    pods = env.cluster.pods().values()
    v_pods = [p for p in pods if p["metadata"]["labels"].get(names.LABEL_ROLE) == "V"]
    assert len(v_pods) == 2 and all(p["metadata"]["labels"][names.LABEL_POOL] == "dec" for p in v_pods)
    await wait_for(lambda: (env.cluster.mllm("demo").get("status") or {}).get("instanceTypes", {}).get("V")
                   == {"desired": 2, "ready": 2}, what="V 2/2 in status")
