"""The worker objects: one Deployment per pool (role-free selector) and the headless Service. Pure."""

from __future__ import annotations

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec
from triptych.operator.objmeta import Obj, Owner, common_labels, object_meta, pool_selector, workers_selector
from triptych.operator.podspec import (
    ADMIN_TOKEN_ENV,
    INTERNAL_TOKEN_ENV,
    add_model,
    base_env,
    http_probe,
    model_dir,
    pod_security_context,
    resources,
    security_context,
    shared_volumes,
    token_env,
    tolerations,
    ucx_env,
    worker_lifecycle,
)
from triptych.operator.policies import worker_port_names
from triptych.operator.pool_spec import SharedGPU, WorkerPool
from triptych.operator.shared_gpu import (
    decode_container,
    ep_args,
    mps_env,
    mps_sidecar,
    mps_volumes,
    workers_annotation,
)
from triptych.topology import UNASSIGNED, InstanceType


def worker_args(spec: MLLMDeploymentSpec, pool: WorkerPool) -> list[str]:
    transfer = "any" if spec.transfer.allow_fallback else "nixl"
    # V pods start as V (a video decoder has no role to switch to or from); every other pod
    # starts unassigned and gets its role from the operator.
    # A shared-GPU pod's first worker is EP from the start (its second, D: shared_gpu.py).
    role = InstanceType.V.value if pool.video_only else InstanceType.EP.value if pool.colocated else UNASSIGNED
    args = ["--model", model_dir(spec.model.source), "--role", role, "--host", "0.0.0.0",
            "--port", str(pool.port), "--instance-id", "$(POD_NAME)",
            "--block-size", str(spec.scheduling.block_size), "--transfer-require", transfer,
            "--dtype", spec.model.dtype, "--device", "cuda" if pool.uses_gpu else "cpu"]
    return args + (ep_args(pool.shared_gpu) if pool.shared_gpu is not None else [])


def worker_deployment(owner: Owner, spec: MLLMDeploymentSpec, pool: WorkerPool, replicas: int) -> Obj:
    lifecycle, grace = worker_lifecycle()
    volumes, mounts = shared_volumes(owner, pool.shm_size)
    init = add_model(spec, pool.image, pool.image_pull_policy, volumes, mounts)
    volumes += [v.model_dump(by_alias=True, exclude_none=True) for v in pool.volumes]
    mounts += [m.model_dump(by_alias=True, exclude_none=True) for m in pool.volume_mounts]
    container = {
        "name": "worker", "image": pool.image, "imagePullPolicy": pool.image_pull_policy,
        "command": ["triptych", "worker"], "args": worker_args(spec, pool),
        "ports": [{"name": names.PORT_NAME, "containerPort": pool.port, "protocol": "TCP"}],
        # Workers hold both tokens: the internal one for peers, the admin one to check /admin calls.
        "env": [*base_env(), *token_env(owner, INTERNAL_TOKEN_ENV, ADMIN_TOKEN_ENV), *ucx_env(spec),
                *(e.model_dump(by_alias=True, exclude_none=True) for e in pool.env)],
        "resources": resources(pool.resources),
        "securityContext": security_context(),
        "volumeMounts": mounts,
        # Liveness on /live: 200 while the process serves HTTP, also while it loads, drains or
        # switches roles (/health is 503 then, and a slow switch would get the container killed).
        "startupProbe": http_probe("/live", 10, 90),
        "readinessProbe": http_probe("/ready", 5, 3),
        "livenessProbe": http_probe("/live", 10, 6),
        "lifecycle": lifecycle,
    }
    pod_spec: Obj = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": grace,
        "containers": [container],
        "volumes": volumes,
    }
    template_meta: Obj = {}
    if pool.shared_gpu is not None:
        template_meta = _share_gpu(pod_spec, init, pool, pool.shared_gpu)
    if init:
        pod_spec["initContainers"] = init
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(pool.node_selector.items()))
    if pool.tolerations:
        pod_spec["tolerations"] = tolerations(pool.tolerations)
    if pool.affinity:
        pod_spec["affinity"] = pool.affinity
    selector = pool_selector(owner, pool.name)
    name = names.worker_deployment_name(owner.name, pool.name)
    pod_labels = {**common_labels(owner, names.COMPONENT_WORKER), names.LABEL_POOL: pool.name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": object_meta(owner, name, names.COMPONENT_WORKER, **{names.LABEL_POOL: pool.name}),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            # No surge: a surge pod on a full GPU node would stay Pending and stall the rollout.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": pod_labels, **template_meta}, "spec": pod_spec},
        },
    }


def _share_gpu(pod_spec: Obj, init: list[Obj], pool: WorkerPool, shared: SharedGPU) -> Obj:
    """An EP + D pod under MPS (shared_gpu.py); returns the template's annotations."""
    volumes, mounts = mps_volumes()
    pod_spec["volumes"] += volumes
    ep = pod_spec["containers"][0]
    ep["volumeMounts"] = [*ep["volumeMounts"], *mounts]
    ep["env"] = [*ep["env"], *mps_env(shared.encode_prefill_thread_percentage)]
    pod_spec["containers"] = [ep, decode_container(ep, pool, shared)]
    init.append(mps_sidecar(pool, shared, mounts))
    return {"annotations": {names.ANNOTATION_WORKERS: workers_annotation(pool, shared)}}


def workers_service(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(owner, names.workers_service_name(owner.name), names.COMPONENT_WORKER),
            "spec": {"clusterIP": "None", "selector": workers_selector(owner),
                     # A shared-GPU pod's D worker is its second port (the ServiceMonitor scrapes both).
                     "ports": [{"name": port, "port": names.WORKER_PORT + i, "targetPort": port, "protocol": "TCP"}
                               for i, port in enumerate(worker_port_names(spec))]}}
