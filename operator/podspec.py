"""Pod-spec pieces shared by worker and router pods: security contexts, env, volumes, probes,
the model mount (and the init container that builds a tiny model). Pure.
"""

from __future__ import annotations

from typing import Any

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec, ModelSource
from triptych.operator.objmeta import Obj, Owner
from triptych.operator.spec_base import ResourceRequirements


def model_dir(source: ModelSource) -> str:
    if source.tiny is not None:
        return f"{names.MODEL_MOUNT}/tiny"
    assert source.path is not None  # guaranteed by ModelSource validation
    if source.pvc is not None or source.volume is not None:
        return f"{names.MODEL_MOUNT}/{source.path.strip('/')}".rstrip("/")
    return source.path


def model_volume(source: ModelSource) -> Obj | None:
    if source.tiny is not None:
        return {"name": "model", "emptyDir": {"sizeLimit": "1Gi"}}
    if source.pvc is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc, "readOnly": True}}
    if source.volume is not None:
        return {"name": "model", **source.volume}
    return None


def security_context() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def pod_security_context() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}


def resources(res: ResourceRequirements) -> Obj:
    out: Obj = {}
    if res.requests:
        out["requests"] = {k: str(v) for k, v in sorted(res.requests.items())}
    if res.limits:
        out["limits"] = {k: str(v) for k, v in sorted(res.limits.items())}
    return out


def downward_env() -> list[Obj]:
    # The transfer agent names itself after the pod and advertises the pod IP to peers.
    def ref(name: str, path: str) -> Obj:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
    return [ref("POD_NAME", "metadata.name"), ref("POD_NAMESPACE", "metadata.namespace"),
            ref("POD_IP", "status.podIP")]


def base_env() -> list[Obj]:
    # Read-only root filesystem: every cache goes to the /tmp emptyDir.
    return [*downward_env(),
            {"name": "TRIPTYCH_CONFIG", "value": f"{names.CONFIG_MOUNT}/{names.CONFIG_FILE}"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "TRIPTYCH_CACHE", "value": "/tmp/triptych"}]


def token_env(owner: Owner, *keys: tuple[str, str]) -> list[Obj]:
    """(env name, Secret key) pairs read from the deployment's tokens Secret: never in args or the CR."""
    secret = names.tokens_secret_name(owner.name)
    return [{"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}} for env, key in keys]


INTERNAL_TOKEN_ENV = (names.ENV_INTERNAL_TOKEN, names.SECRET_KEY_INTERNAL_TOKEN)
ADMIN_TOKEN_ENV = (names.ENV_ADMIN_TOKEN, names.SECRET_KEY_ADMIN_TOKEN)


def ucx_env(spec: MLLMDeploymentSpec) -> list[Obj]:
    ucx = spec.transfer.ucx
    env = dict(sorted(ucx.env.items()))
    tls = ucx.tls or ("^tcp" if spec.transfer.require_rdma else None)
    if tls:
        env["UCX_TLS"] = tls
    if ucx.net_devices:
        env["UCX_NET_DEVICES"] = ucx.net_devices
    return [{"name": k, "value": v} for k, v in env.items()]


def shared_volumes(owner: Owner, shm_size: str | int | None) -> tuple[list[Obj], list[Obj]]:
    volumes = [{"name": "config", "configMap": {"name": names.config_map_name(owner.name)}},
               {"name": "tmp", "emptyDir": {"sizeLimit": names.TMP_SIZE_LIMIT}}]
    mounts = [{"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if shm_size is not None:  # the engine's shared-memory tensors (and NCCL/UCX) live in /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm_size)}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def add_model(spec: MLLMDeploymentSpec, image: str, pull: str, volumes: list[Obj],
               mounts: list[Obj]) -> list[Obj]:
    """Mount the model read-only; for `tiny`, an init container builds it first."""
    source = spec.model.source
    volume = model_volume(source)
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
        "securityContext": security_context(),
        "volumeMounts": [{"name": "model", "mountPath": names.MODEL_MOUNT},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }]


def http_probe(path: str, period: int, failures: int, port: str = names.PORT_NAME) -> Obj:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def tolerations(tolerations: list[Any]) -> list[Obj]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def worker_lifecycle() -> tuple[Obj, int]:
    """The worker's preStop hook and its termination grace period.

    The worker has no drain endpoint: it drains on SIGTERM (worker/draining.py DrainingServer).
    The preStop hook is the kubelet's built-in `sleep` action (no binary needed in the image):
    it delays SIGTERM until the endpoints controller and the router's pod watch have seen the
    pod terminate, so no new request is routed to a worker that is already draining. The grace
    period covers that sleep, the worker's drain timeout and a margin for teardown.
    """
    grace = names.PRESTOP_SLEEP_S + names.WORKER_DRAIN_TIMEOUT_S + names.GRACE_MARGIN_S
    return {"preStop": {"sleep": {"seconds": names.PRESTOP_SLEEP_S}}}, grace
