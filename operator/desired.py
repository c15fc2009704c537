"""The desired state: an MLLMDeployment (already validated) -> the child objects it should have.

Pure: no I/O and no clock. The same resource always renders byte-identical objects, each
carrying a hash of its own content (`triptych.dev/spec-hash`) so the reconcile pass
(reconcile.py) writes only what changed.

Per deployment `m` in namespace `ns`:
  ConfigMap m-config (serving config), ServiceAccount + RoleBinding m-router (pod watch for
  the router's discovery), one Deployment m-<pool> per worker pool (selector without the
  role, so a pod's role label can change in place), headless Service m-workers, router
  Deployment + Service m-router, PodDisruptionBudgets, a NetworkPolicy for the workers and,
  when the Prometheus Operator CRD exists, a ServiceMonitor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from triptych.kube import names
from triptych.operator.api import (
    MLLMDeploymentSpec,
    ModelSource,
    ResourceRequirements,
    WorkerPool,
    pool_assignment,
    topology_string,
)
from triptych.topology import InstanceType

Obj = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """The MLLMDeployment being reconciled (what owner references need)."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class ClusterFacts:
    """What the cluster offers, discovered by the caller (the only non-spec inputs)."""

    service_monitor_crd: bool = False
    operator_namespace: str | None = None  # None: allow the operator's pods from any namespace
    operator_labels: dict[str, str] = field(default_factory=lambda: {names.LABEL_NAME: names.OPERATOR_NAME})


@dataclass(frozen=True)
class Desired:
    objects: list[Obj]
    pool_counts: dict[str, dict[InstanceType, int]]  # pool -> instances per type

    def by_kind(self, kind: str) -> dict[str, Obj]:
        return {o["metadata"]["name"]: o for o in self.objects if o["kind"] == kind}


def desired_objects(owner: Owner, spec: MLLMDeploymentSpec, facts: ClusterFacts) -> Desired:
    counts = pool_assignment(spec)
    objects: list[Obj] = [_config_map(owner, spec, counts), *_router_rbac(owner)]
    for pool in spec.effective_pools():
        replicas = sum(counts[pool.name].values())
        objects.append(_worker_deployment(owner, spec, pool, replicas))
        objects.append(_pdb(owner, names.worker_deployment_name(owner.name, pool.name),
                            _pool_selector(owner, pool.name), pool.max_unavailable, names.COMPONENT_WORKER))
    objects += [
        _workers_service(owner, spec),
        _router_deployment(owner, spec),
        _router_service(owner, spec),
        _pdb(owner, names.router_name(owner.name), _router_selector(owner), 1, names.COMPONENT_ROUTER),
    ]
    if spec.network_policy.enabled:
        objects.append(_network_policy(owner, spec, facts))
    if spec.monitoring.service_monitor and facts.service_monitor_crd:
        objects.append(_service_monitor(owner, spec))
    return Desired([_finalize(o, owner) for o in objects], counts)


def spec_hash(obj: Obj) -> str:
    """Hash of an object's content without the hash annotation itself."""
    meta = dict(obj.get("metadata", {}))
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != names.ANNOTATION_SPEC_HASH}
    meta["annotations"] = annotations
    canonical = json.dumps({**obj, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _finalize(obj: Obj, owner: Owner) -> Obj:
    meta = obj["metadata"]
    meta["namespace"] = owner.namespace
    meta["ownerReferences"] = [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": owner.name,
                                "uid": owner.uid, "controller": True}]
    meta.setdefault("annotations", {})[names.ANNOTATION_SPEC_HASH] = spec_hash(obj)
    return obj


# --- labels -------------------------------------------------------------------------------

def common_labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        names.LABEL_NAME: "triptych",
        names.LABEL_INSTANCE: owner.name,
        names.LABEL_COMPONENT: component,
        names.LABEL_PART_OF: "triptych",
        names.LABEL_MANAGED_BY: names.OPERATOR_NAME,
        names.LABEL_DEPLOYMENT: owner.name,
    }


def _pool_selector(owner: Owner, pool: str) -> dict[str, str]:
    # Deliberately without the role: a pod keeps its Deployment when its role changes.
    return {names.LABEL_INSTANCE: owner.name, names.LABEL_COMPONENT: names.COMPONENT_WORKER, names.LABEL_POOL: pool}


def _workers_selector(owner: Owner) -> dict[str, str]:
    return {names.LABEL_INSTANCE: owner.name, names.LABEL_COMPONENT: names.COMPONENT_WORKER}


def _router_selector(owner: Owner) -> dict[str, str]:
    return {names.LABEL_INSTANCE: owner.name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}


def _meta(owner: Owner, name: str, component: str, **extra_labels: str) -> Obj:
    return {"name": name, "labels": {**common_labels(owner, component), **extra_labels}}


# --- config, RBAC ------------------------------------------------------------------------

def serving_config(spec: MLLMDeploymentSpec, counts: dict[str, dict[InstanceType, int]], name: str) -> Obj:
    """The serving config every worker and the router read from TRIPTYCH_CONFIG."""
    m = spec.model
    return {
        "model": {"path": model_dir(m.source), "servedModelName": m.served_model_name or name,
                  "family": m.family, "dtype": m.dtype, "maxModelLen": m.max_model_len},
        "topology": topology_string(spec),
        "pools": {pool: {t.value: n for t, n in c.items()} for pool, c in counts.items()},
        "slo": spec.slo.model_dump(by_alias=True),
        "scheduling": spec.scheduling.model_dump(by_alias=True),
        "transfer": spec.transfer.model_dump(by_alias=True),
    }


def _config_map(owner: Owner, spec: MLLMDeploymentSpec, counts: dict[str, dict[InstanceType, int]]) -> Obj:
    config = serving_config(spec, counts, owner.name)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(owner, names.config_map_name(owner.name), "config"),
            "data": {names.CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)}}


def _router_rbac(owner: Owner) -> list[Obj]:
    name = names.router_name(owner.name)
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": _meta(owner, name, names.COMPONENT_ROUTER)}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(owner, name, names.COMPONENT_ROUTER),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": names.ROUTER_CLUSTER_ROLE},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]}
    return [account, binding]


# --- pods ----------------------------------------------------------------------------------

def model_dir(source: ModelSource) -> str:
    if source.tiny is not None:
        return f"{names.MODEL_MOUNT}/tiny"
    assert source.path is not None  # guaranteed by ModelSource validation
    if source.pvc is not None or source.volume is not None:
        return f"{names.MODEL_MOUNT}/{source.path.strip('/')}".rstrip("/")
    return source.path


def _model_volume(source: ModelSource) -> Obj | None:
    if source.tiny is not None:
        return {"name": "model", "emptyDir": {"sizeLimit": "1Gi"}}
    if source.pvc is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc, "readOnly": True}}
    if source.volume is not None:
        return {"name": "model", **source.volume}
    return None


def _security_context() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _pod_security_context() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _resources(res: ResourceRequirements) -> Obj:
    out: Obj = {}
    if res.requests:
        out["requests"] = {k: str(v) for k, v in sorted(res.requests.items())}
    if res.limits:
        out["limits"] = {k: str(v) for k, v in sorted(res.limits.items())}
    return out


def _downward_env() -> list[Obj]:
    # The transfer agent names itself after the pod and advertises the pod IP to peers.
    def ref(name: str, path: str) -> Obj:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
    return [ref("POD_NAME", "metadata.name"), ref("POD_NAMESPACE", "metadata.namespace"),
            ref("POD_IP", "status.podIP")]


def _base_env() -> list[Obj]:
    # Read-only root filesystem: every cache goes to the /tmp emptyDir.
    return [*_downward_env(),
            {"name": "TRIPTYCH_CONFIG", "value": f"{names.CONFIG_MOUNT}/{names.CONFIG_FILE}"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "TRIPTYCH_CACHE", "value": "/tmp/triptych"}]


def _ucx_env(spec: MLLMDeploymentSpec) -> list[Obj]:
    ucx = spec.transfer.ucx
    env = dict(sorted(ucx.env.items()))
    tls = ucx.tls or ("^tcp" if spec.transfer.require_rdma else None)
    if tls:
        env["UCX_TLS"] = tls
    if ucx.net_devices:
        env["UCX_NET_DEVICES"] = ucx.net_devices
    return [{"name": k, "value": v} for k, v in env.items()]


def _shared_volumes(owner: Owner, shm_size: str | int | None) -> tuple[list[Obj], list[Obj]]:
    volumes = [{"name": "config", "configMap": {"name": names.config_map_name(owner.name)}},
               {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if shm_size is not None:  # the engine's shared-memory tensors (and NCCL/UCX) live in /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm_size)}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _add_model(spec: MLLMDeploymentSpec, image: str, pull: str, volumes: list[Obj],
               mounts: list[Obj]) -> list[Obj]:
    """Mount the model read-only; for `tiny`, an init container builds it first."""
    source = spec.model.source
    volume = _model_volume(source)
    if volume is None:
        return []
    volumes.append(volume)
    mounts.append({"name": "model", "mountPath": names.MODEL_MOUNT, "readOnly": True})
    if source.tiny is None:
        return []
    return [{
        "name": "make-tiny-model", "image": image, "imagePullPolicy": pull,
        "command": ["triptych", "make-tiny-model"],
        "args": ["--family", source.tiny, "--out", model_dir(source)],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "model", "mountPath": names.MODEL_MOUNT},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }]


def _http_probe(path: str, period: int, failures: int) -> Obj:
    return {"httpGet": {"path": path, "port": names.PORT_NAME}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _tolerations(tolerations: list[Any]) -> list[Obj]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def worker_args(spec: MLLMDeploymentSpec, pool: WorkerPool) -> list[str]:
    transfer = "any" if spec.transfer.allow_fallback else "nixl"
    return ["--model", model_dir(spec.model.source), "--role", "unassigned", "--host", "0.0.0.0",
            "--port", str(pool.port), "--instance-id", "$(POD_NAME)",
            "--block-size", str(spec.scheduling.block_size), "--transfer-require", transfer,
            "--dtype", spec.model.dtype, "--device", "cuda" if pool.uses_gpu else "cpu"]


def _worker_deployment(owner: Owner, spec: MLLMDeploymentSpec, pool: WorkerPool, replicas: int) -> Obj:
    volumes, mounts = _shared_volumes(owner, pool.shm_size)
    init = _add_model(spec, pool.image, pool.image_pull_policy, volumes, mounts)
    volumes += [v.model_dump(by_alias=True, exclude_none=True) for v in pool.volumes]
    mounts += [m.model_dump(by_alias=True, exclude_none=True) for m in pool.volume_mounts]
    container = {
        "name": "worker", "image": pool.image, "imagePullPolicy": pool.image_pull_policy,
        "command": ["triptych", "worker"], "args": worker_args(spec, pool),
        "ports": [{"name": names.PORT_NAME, "containerPort": pool.port, "protocol": "TCP"}],
        "env": [*_base_env(), *_ucx_env(spec),
                *(e.model_dump(by_alias=True, exclude_none=True) for e in pool.env)],
        "resources": _resources(pool.resources),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
        # Loading weights can take minutes: the startup probe holds liveness off until then.
        "startupProbe": _http_probe("/health", 10, 90),
        "readinessProbe": _http_probe("/ready", 5, 3),
        "livenessProbe": _http_probe("/health", 10, 6),
    }
    pod_spec: Obj = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    if init:
        pod_spec["initContainers"] = init
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(pool.node_selector.items()))
    if pool.tolerations:
        pod_spec["tolerations"] = _tolerations(pool.tolerations)
    if pool.affinity:
        pod_spec["affinity"] = pool.affinity
    selector = _pool_selector(owner, pool.name)
    name = names.worker_deployment_name(owner.name, pool.name)
    pod_labels = {**common_labels(owner, names.COMPONENT_WORKER), names.LABEL_POOL: pool.name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(owner, name, names.COMPONENT_WORKER, **{names.LABEL_POOL: pool.name}),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            # No surge: a surge pod on a full GPU node would stay Pending and stall the rollout.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def router_args(owner: Owner, spec: MLLMDeploymentSpec) -> list[str]:
    args = ["--model", model_dir(spec.model.source), "--host", "0.0.0.0", "--port", str(spec.router.port),
            "--served-model-name", spec.model.served_model_name or owner.name,
            "--discovery", "kubernetes", "--k8s-namespace", owner.namespace, "--k8s-deployment", owner.name,
            # The router does not read the serving config: its SLO metrics and context limit come as flags.
            "--ttft-slo", f"{spec.slo.ttft_ms / 1000:g}", "--tbt-slo", f"{spec.slo.tbt_ms / 1000:g}",
            "--slo-attainment-target", f"{spec.slo.attainment_target:g}"]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.router.api_keys_secret_ref is not None:
        args += ["--api-key-file", f"{names.SECRETS_MOUNT}/api-keys"]
    return args


def _router_deployment(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    router = spec.router
    volumes, mounts = _shared_volumes(owner, None)
    init = _add_model(spec, router.image, router.image_pull_policy, volumes, mounts)
    if router.api_keys_secret_ref is not None:
        ref = router.api_keys_secret_ref
        volumes.append({"name": "api-keys", "secret": {"secretName": ref.name,
                                                       "items": [{"key": ref.key, "path": "api-keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": names.SECRETS_MOUNT, "readOnly": True})
    container = {
        "name": "router", "image": router.image, "imagePullPolicy": router.image_pull_policy,
        "command": ["triptych", "router"], "args": router_args(owner, spec),
        "ports": [{"name": names.PORT_NAME, "containerPort": router.port, "protocol": "TCP"}],
        "env": _base_env(),
        "resources": _resources(router.resources),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
        "startupProbe": _http_probe("/live", 5, 60),
        "readinessProbe": _http_probe("/ready", 5, 3),
        "livenessProbe": _http_probe("/live", 10, 6),
    }
    pod_spec: Obj = {
        "serviceAccountName": names.router_name(owner.name),  # pod watch for discovery
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if init:
        pod_spec["initContainers"] = init
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(router.node_selector.items()))
    if router.tolerations:
        pod_spec["tolerations"] = _tolerations(router.tolerations)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(owner, names.router_name(owner.name), names.COMPONENT_ROUTER),
        "spec": {
            "replicas": router.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": _router_selector(owner)},
            "template": {"metadata": {"labels": common_labels(owner, names.COMPONENT_ROUTER)},
                         "spec": pod_spec},
        },
    }


# --- services, disruption budgets, network policy, monitoring ------------------------------

def _workers_service(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, names.workers_service_name(owner.name), names.COMPONENT_WORKER),
            "spec": {"clusterIP": "None", "selector": _workers_selector(owner),
                     "ports": [{"name": names.PORT_NAME, "port": names.WORKER_PORT, "targetPort": names.PORT_NAME,
                                "protocol": "TCP"}]}}


def _router_service(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, names.router_name(owner.name), names.COMPONENT_ROUTER),
            "spec": {"type": spec.router.service_type, "selector": _router_selector(owner),
                     "ports": [{"name": names.PORT_NAME, "port": spec.router.port, "targetPort": names.PORT_NAME,
                                "protocol": "TCP"}]}}


def _pdb(owner: Owner, name: str, selector: dict[str, str], max_unavailable: int, component: str) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(owner, name, component),
            "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": selector}}}


def _network_policy(owner: Owner, spec: MLLMDeploymentSpec, facts: ClusterFacts) -> Obj:
    namespace_selector = ({"matchLabels": {"kubernetes.io/metadata.name": facts.operator_namespace}}
                          if facts.operator_namespace else {})
    http = [{"port": names.PORT_NAME, "protocol": "TCP"}]
    ingress: list[Obj] = [
        # Workers reach each other on any port: NIXL/UCX listens on ephemeral ports.
        {"from": [{"podSelector": {"matchLabels": _workers_selector(owner)}}]},
        {"from": [{"podSelector": {"matchLabels": _router_selector(owner)}},
                  {"namespaceSelector": namespace_selector,
                   "podSelector": {"matchLabels": dict(facts.operator_labels)}}],
         "ports": http},
    ]
    if spec.network_policy.additional_ingress:
        ingress.append({"from": list(spec.network_policy.additional_ingress), "ports": http})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(owner, names.workers_service_name(owner.name), names.COMPONENT_WORKER),
            "spec": {"podSelector": {"matchLabels": _workers_selector(owner)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def _service_monitor(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(owner, owner.name, "monitoring"),
            "spec": {"selector": {"matchLabels": {names.LABEL_INSTANCE: owner.name,
                                                  names.LABEL_MANAGED_BY: names.OPERATOR_NAME}},
                     "namespaceSelector": {"matchNames": [owner.namespace]},
                     "endpoints": [{"port": names.PORT_NAME, "path": "/metrics",
                                    "interval": spec.monitoring.interval}]}}
