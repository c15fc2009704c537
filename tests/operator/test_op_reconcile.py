"""The pure reconcile function: topologies, pool layouts, scale changes, offline validation."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from triptych.cli import build_parser
from triptych.kube import names
from triptych.operator.api import parse_spec
from triptych.operator.desired import ClusterFacts, Desired, Owner, desired_objects, spec_hash
from triptych.operator.router_objects import ROUTER_RULES
from triptych.router.config import RouterConfig
from triptych.topology import InstanceType

OWNER = Owner(name="demo", namespace="serving", uid="6d0c0a7e-0000-4000-8000-000000000001")
FACTS = ClusterFacts(service_monitor_crd=True, operator_namespace="triptych-system")
K8S_VERSIONS = ("1.33", kubernetes_validate.latest_version())
BUILTIN = {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget",
           "NetworkPolicy"}

# Prometheus Operator's ServiceMonitor is itself a CRD: kubernetes-validate has no schema for
# it, so the fields we set are checked against this minimal excerpt of its schema.
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
                     "namespaceSelector": {"type": "object", "additionalProperties": False,
                                           "properties": {"matchNames": {"type": "array"}, "any": {"type": "boolean"}}},
                     "endpoints": {"type": "array", "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}}}},
    },
}


def render(spec: dict[str, Any], facts: ClusterFacts = FACTS) -> Desired:
    return desired_objects(OWNER, parse_spec(spec, name=OWNER.name), facts)


def tiny(topology: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"model": {"source": {"tiny": "qwen2-vl"}, "dtype": "float32"}, "topology": topology, **extra}


GPU_POOL = {"name": "gpu", "resources": {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1},
                                         "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "shmSize": "16Gi",
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                   "labelSelector": {"matchLabels": {names.LABEL_POOL: "gpu"}}}}]}}}

LAYOUTS = {
    "default-pool-1E1P1D": (tiny({"E": 1, "P": 1, "D": 1}), {"workers": {"E": 1, "P": 1, "D": 1}}),
    "EPD-aggregated": (tiny({"EPD": 2}), {"workers": {"EPD": 2}}),
    "EP+D-two-pools": (tiny({"EP": 2, "D": 2}, pools=[{"name": "ep", "instanceTypes": ["EP"]},
                                                      {"name": "d", "instanceTypes": ["D"]}]),
                       {"ep": {"EP": 2}, "d": {"D": 2}}),
    "E+P+D-gpu": ({"model": {"source": {"pvc": "models", "path": "Qwen2-VL-7B-Instruct"}},
                   "topology": {"E": 2, "P": 1, "D": 3}, "pools": [GPU_POOL],
                   "router": {"replicas": 2, "serviceType": "LoadBalancer",
                              "apiKeysSecretRef": {"name": "keys"}},
                   "transfer": {"requireRdma": True, "ucx": {"netDevices": "mlx5_0:1"}}},
                  {"gpu": {"E": 2, "P": 1, "D": 3}}),
    "first-allowing-pool-wins": (tiny({"E": 1, "PD": 2}, pools=[{"name": "enc", "instanceTypes": ["E", "PD"]},
                                                               {"name": "llm", "instanceTypes": ["PD"]}]),
                                 {"enc": {"E": 1, "PD": 2}, "llm": {}}),
    "ED+P-volume": ({"model": {"source": {"volume": {"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {
                                              "server": "nfs.local", "share": "/export"}}},
                                          "path": "llava"}},
                     "topology": {"ED": 1, "P": 1},
                     "pools": [{"name": "w", "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
                                "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}],
                                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}]},
                    {"w": {"ED": 1, "P": 1}}),
}


def validate_offline(obj: dict[str, Any], version: str) -> None:
    if obj["kind"] == "ServiceMonitor":
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
        return
    assert obj["kind"] in BUILTIN, f"unexpected kind {obj['kind']}"
    # SchemaNotFoundError ("couldn't find schema") propagates: for built-in kinds it is a failure.
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pool_counts(layout: str) -> None:
    spec, expected = LAYOUTS[layout]
    got = {pool: {t.value: n for t, n in counts.items()} for pool, counts in render(spec).pool_counts.items()}
    assert got == expected
    for pool, counts in expected.items():
        dep = render(spec).by_kind("Deployment")[f"demo-{pool}"]
        assert dep["spec"]["replicas"] == sum(counts.values())


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_object_validates_strictly(layout: str, version: str) -> None:
    desired = render(LAYOUTS[layout][0])
    kinds = {o["kind"] for o in desired.objects}
    assert BUILTIN <= kinds and "ServiceMonitor" in kinds
    for obj in desired.objects:
        validate_offline(obj, version)


def test_strict_validation_is_not_a_no_op() -> None:
    dep = copy.deepcopy(render(LAYOUTS["default-pool-1E1P1D"][0]).by_kind("Deployment")["demo-workers"])
    dep["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_offline(dep, K8S_VERSIONS[0])
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "example.com/v1", "kind": "Nope", "metadata": {}},
                                     K8S_VERSIONS[0], strict=True)


def test_objects_are_owned_labelled_and_hashed() -> None:
    for obj in render(LAYOUTS["E+P+D-gpu"][0]).objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [{"apiVersion": "triptych.dev/v1alpha1", "kind": "MLLMDeployment",
                                            "name": "demo", "uid": OWNER.uid, "controller": True}]
        assert meta["labels"][names.LABEL_DEPLOYMENT] == "demo"
        assert meta["labels"][names.LABEL_PART_OF] == "triptych"
        assert meta["annotations"][names.ANNOTATION_SPEC_HASH] == spec_hash(obj)


def test_reconcile_is_deterministic() -> None:
    spec = LAYOUTS["E+P+D-gpu"][0]
    assert json.dumps(render(spec).objects) == json.dumps(render(copy.deepcopy(spec)).objects)


def _hashes(desired: Desired) -> dict[tuple[str, str], str]:
    return {(o["kind"], o["metadata"]["name"]): o["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]
            for o in desired.objects}


@pytest.mark.parametrize(("before", "after", "changed"), [
    (tiny({"E": 1, "P": 1, "D": 1}), tiny({"E": 1, "P": 1, "D": 3}),
     {("Deployment", "demo-workers"), ("ConfigMap", "demo-config")}),
    (tiny({"E": 1, "P": 1, "D": 2}, pools=[{"name": "e", "instanceTypes": ["E"]},
                                          {"name": "pd", "instanceTypes": ["P", "D"]}]),
     tiny({"E": 1, "P": 1, "D": 1}, pools=[{"name": "e", "instanceTypes": ["E"]},
                                          {"name": "pd", "instanceTypes": ["P", "D"]}]),
     {("Deployment", "demo-pd"), ("ConfigMap", "demo-config")}),
    (tiny({"E": 1, "P": 1, "D": 1}), tiny({"E": 1, "P": 1, "D": 1}, router={"replicas": 3}),
     {("Deployment", "demo-router")}),
    (tiny({"E": 1, "P": 1, "D": 1}), tiny({"E": 1, "P": 1, "D": 1}, slo={"ttftMs": 500}),
     {("ConfigMap", "demo-config"), ("Deployment", "demo-router")}),  # the router takes the SLO as flags
])
def test_scale_changes_touch_only_what_they_must(before: dict[str, Any], after: dict[str, Any],
                                                 changed: set[tuple[str, str]]) -> None:
    old, new = _hashes(render(before)), _hashes(render(after))
    assert old.keys() == new.keys()
    assert {k for k in old if old[k] != new[k]} == changed


def test_worker_pods_are_locked_down_and_start_unassigned() -> None:
    desired = render(LAYOUTS["E+P+D-gpu"][0])
    dep = desired.by_kind("Deployment")["demo-gpu"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert names.LABEL_ROLE not in selector  # a role change never moves a pod out of its Deployment
    template = dep["spec"]["template"]
    assert selector.items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert c["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
                              "limits": {"memory": "64Gi", "nvidia.com/gpu": "1"}}
    assert c["command"] == ["triptych", "worker"]
    args = dict(zip(c["args"][::2], c["args"][1::2], strict=True))
    assert args["--role"] == "unassigned" and args["--device"] == "cuda" and args["--instance-id"] == "$(POD_NAME)"
    assert args["--model"] == "/models/Qwen2-VL-7B-Instruct" and args["--transfer-require"] == "nixl"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/live"
    assert c["startupProbe"]["httpGet"]["path"] == "/live"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["UCX_TLS"]["value"] == "^tcp" and env["UCX_NET_DEVICES"]["value"] == "mlx5_0:1"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm" and mounts["/models"]["readOnly"] is True
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_tiny_model_is_built_by_an_init_container_on_cpu() -> None:
    desired = render(LAYOUTS["default-pool-1E1P1D"][0])
    for name in ("demo-workers", "demo-router"):
        pod = desired.by_kind("Deployment")[name]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["args"] == ["--family", "qwen2-vl", "--out", "/models/tiny"]
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
    worker = desired.by_kind("Deployment")["demo-workers"]["spec"]["template"]["spec"]["containers"][0]
    assert "--device" in worker["args"] and worker["args"][worker["args"].index("--device") + 1] == "cpu"


def test_router_discovers_its_own_workers_with_its_own_account() -> None:
    desired = render(LAYOUTS["E+P+D-gpu"][0])
    dep = desired.by_kind("Deployment")["demo-router"]
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2
    assert pod["serviceAccountName"] == "demo-router"
    args = pod["containers"][0]["args"]
    joined = " ".join(args)
    assert "--discovery kubernetes --k8s-namespace serving --k8s-deployment demo" in joined
    assert "--api-key-file /etc/triptych/secrets/api-keys" in joined
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert pod["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/live"
    binding = desired.by_kind("RoleBinding")["demo-router"]
    role = desired.by_kind("Role")["demo-router"]
    assert role["rules"] == ROUTER_RULES  # checked against the discovery's requests in test_op_k8s_discovery
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-router"}
    assert not any(o["kind"].startswith("Cluster") for o in desired.objects)  # no cluster-scoped RBAC
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router", "namespace": "serving"}]
    service = desired.by_kind("Service")["demo-router"]
    assert service["spec"]["type"] == "LoadBalancer"


def test_services_budgets_and_network_policy() -> None:
    desired = render(LAYOUTS["EP+D-two-pools"][0])
    assert desired.by_kind("Service")["demo-workers"]["spec"]["clusterIP"] == "None"
    assert set(desired.by_kind("PodDisruptionBudget")) == {"demo-ep", "demo-d", "demo-router"}
    policy = desired.by_kind("NetworkPolicy")["demo-workers"]["spec"]
    workers = {names.LABEL_INSTANCE: "demo", names.LABEL_COMPONENT: "worker"}
    assert policy["podSelector"] == {"matchLabels": workers}
    peers = [peer for rule in policy["ingress"] for peer in rule["from"]]
    assert {"podSelector": {"matchLabels": workers}} in peers
    assert {"podSelector": {"matchLabels": {names.LABEL_INSTANCE: "demo", names.LABEL_COMPONENT: "router"}}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "triptych-system"}},
            "podSelector": {"matchLabels": {names.LABEL_NAME: names.OPERATOR_NAME}}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}} in peers  # the scrapers
    assert len(peers) == 4  # nobody else


def test_optional_objects_follow_facts_and_spec() -> None:
    spec = tiny({"EPD": 1})
    assert "ServiceMonitor" not in {o["kind"] for o in render(spec, ClusterFacts()).objects}
    assert "ServiceMonitor" in {o["kind"] for o in render(spec).objects}
    off = tiny({"EPD": 1}, monitoring={"serviceMonitor": False}, networkPolicy={"enabled": False})
    kinds = {o["kind"] for o in render(off).objects}
    assert "ServiceMonitor" not in kinds and "NetworkPolicy" not in kinds


def test_serving_config_carries_the_whole_serving_spec() -> None:
    config = json.loads(render(LAYOUTS["E+P+D-gpu"][0]).by_kind("ConfigMap")["demo-config"]["data"]["serving.json"])
    assert config["topology"] == "2E1P3D"
    assert config["pools"] == {"gpu": {"E": 2, "P": 1, "D": 3}}
    assert config["model"]["path"] == "/models/Qwen2-VL-7B-Instruct"
    assert config["model"]["servedModelName"] == "demo"
    assert config["transfer"]["requireRdma"] is True
    assert set(config["slo"]) == {"ttftMs", "tbtMs", "attainmentTarget"}


def test_instance_types_all_have_a_pool_in_every_layout() -> None:
    for spec, _ in LAYOUTS.values():
        counts = render(spec).pool_counts
        placed = {t for c in counts.values() for t, n in c.items() if n}
        assert placed == {InstanceType(t) for t, n in spec["topology"].items() if n}


def _router_config(desired: Desired) -> RouterConfig:
    """The router's config exactly as `triptych router` builds it from the rendered args."""
    (container,) = desired.by_kind("Deployment")["demo-router"]["spec"]["template"]["spec"]["containers"]
    return RouterConfig.from_cli(build_parser().parse_args([*container["command"][1:], *container["args"]]))


def test_router_gets_the_slo_and_the_context_limit_as_flags() -> None:
    spec = tiny({"EPD": 1}, slo={"ttftMs": 500, "tbtMs": 40, "attainmentTarget": 0.95})
    spec["model"]["maxModelLen"] = 4096
    config = _router_config(render(spec))
    assert (config.ttft_slo_s, config.tbt_slo_s, config.slo_attainment_target, config.max_model_len) == (
        0.5, 0.04, 0.95, 4096)
    assert config.model_name == "demo"
    default = _router_config(render(tiny({"EPD": 1})))  # the CRD's defaults, not the router's
    assert (default.ttft_slo_s, default.tbt_slo_s, default.slo_attainment_target) == (2.0, 0.2, 0.9)
    assert default.max_model_len is None  # then the router reads the checkpoint's config.json


def test_router_exports_its_attainment_target(qwen2_vl_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from triptych.router.main import build

    args = build_parser().parse_args(["router", "--model", str(qwen2_vl_dir), "--served-model-name", "m",
                                      "--slo-attainment-target", "0.95", "--max-model-len", "64"])
    with TestClient(build(RouterConfig.from_cli(args), [])) as client:
        metrics = client.get("/metrics").text
    assert 'triptych_frontend_slo_attainment_target{model="m"} 0.95' in metrics
