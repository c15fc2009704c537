"""A shared-GPU pod (pool option `sharedGpu`): an EP worker and a D worker on one GPU under
NVIDIA MPS (UnifiedServe §4.1: "multiple stages ... execute in parallel via resource
sharing (MPS)"; §4.4: the decode worker in a process of its own, encode and prefill
co-scheduled in one). Pure.

The pod holds:
- `mps-control`: a native sidecar (an init container with restartPolicy Always, so it is up
  before the workers start and stays up beside them) running the MPS control daemon.
  `nvidia-cuda-mps-control -f` is the daemon in the foreground: `-d` forks and exits,
  which would end the container. Its pipe and log directories are emptyDirs every
  container mounts, named by CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY; MPS clients
  must run as the daemon's user, which the pod security context makes the same (1000).
- `worker`: `--role EP` on the pool's port, with the encode and prefill token budgets
  (UnifiedServe §4.5, Alg. 3: alpha = `--encode-token-budget`, tau = `--token-budget`),
  which bound each EP iteration's compute and so the decode's interference.
- `worker-decode`: `--role D` on `sharedGpu.decodePort` (port name `http-decode`).

The GPU is requested once, by the `worker` container (the device plugin allocates a GPU to
one container); the daemon and the D worker see the node's GPUs through
NVIDIA_VISIBLE_DEVICES=all (the NVIDIA container toolkit's default for unprivileged
containers), so a shared-GPU pool belongs on nodes with one GPU (nodeSelector).
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps a worker's share of the SMs when given.

Both roles are fixed at start; the pod's `triptych.dev/workers` annotation lists them with
their ports for the router's discovery (router/k8s_discovery.py), and its role label is EP.
"""

from __future__ import annotations

from triptych.kube import names
from triptych.operator.objmeta import Obj
from triptych.operator.podspec import security_context
from triptych.operator.pool_spec import SharedGPU, WorkerPool
from triptych.topology import InstanceType

MPS_VOLUMES = (("mps-pipe", names.MPS_PIPE_DIR), ("mps-log", names.MPS_LOG_DIR))


def mps_env(percentage: int | None = None) -> list[Obj]:
    env = [{"name": "CUDA_MPS_PIPE_DIRECTORY", "value": names.MPS_PIPE_DIR},
           {"name": "CUDA_MPS_LOG_DIRECTORY", "value": names.MPS_LOG_DIR}]
    if percentage is not None:
        env.append({"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": str(percentage)})
    return env


def mps_volumes() -> tuple[list[Obj], list[Obj]]:
    """The daemon's pipe (in memory) and log directories, and every container's mounts of them."""
    volumes = [{"name": "mps-pipe", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
               {"name": "mps-log", "emptyDir": {"sizeLimit": "64Mi"}}]
    return volumes, [{"name": n, "mountPath": path} for n, path in MPS_VOLUMES]


def mps_sidecar(pool: WorkerPool, shared: SharedGPU, mounts: list[Obj]) -> Obj:
    return {
        "name": "mps-control", "image": shared.mps_image or pool.image, "imagePullPolicy": pool.image_pull_policy,
        "restartPolicy": "Always",  # a native sidecar: started before the workers, kept beside them
        "command": ["nvidia-cuda-mps-control", "-f"],
        "env": [*mps_env(), {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": security_context(),
        "volumeMounts": mounts,
        # The workers start once the daemon's control pipe exists (else CUDA runs without MPS).
        "startupProbe": {"exec": {"command": ["sh", "-c", f"test -e {names.MPS_PIPE_DIR}/control"]},
                         "periodSeconds": 1, "failureThreshold": 60},
    }


def ep_args(shared: SharedGPU) -> list[str]:
    return ["--token-budget", str(shared.prefill_token_budget),
            "--encode-token-budget", str(shared.encode_token_budget)]


def workers_annotation(pool: WorkerPool, shared: SharedGPU) -> str:
    return f"{InstanceType.EP.value}={pool.port},{InstanceType.D.value}={shared.decode_port}"


def decode_container(ep: Obj, pool: WorkerPool, shared: SharedGPU) -> Obj:
    """The D worker: the EP container's spec with its own role, port, id, probes and no GPU."""
    args = list(ep["args"])
    for flag in ("--token-budget", "--encode-token-budget"):  # the EP instance's budgets only
        i = args.index(flag)
        del args[i:i + 2]
    args[args.index("--role") + 1] = InstanceType.D.value
    args[args.index("--port") + 1] = str(shared.decode_port)
    args[args.index("--instance-id") + 1] = "$(POD_NAME)-d"
    limits = {k: v for k, v in ep["resources"].get("limits", {}).items() if k != "nvidia.com/gpu"}
    requests = {k: v for k, v in ep["resources"].get("requests", {}).items() if k != "nvidia.com/gpu"}
    env = [e for e in ep["env"] if e["name"] != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
    env += [*mps_env(shared.decode_thread_percentage)[2:], {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    probes = {k: {**ep[k], "httpGet": {**ep[k]["httpGet"], "port": names.DECODE_PORT_NAME}}
              for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    return {**ep, "name": "worker-decode", "args": args, "env": env, **probes,
            "ports": [{"name": names.DECODE_PORT_NAME, "containerPort": shared.decode_port, "protocol": "TCP"}],
            "resources": {k: v for k, v in (("requests", requests), ("limits", limits)) if v}}
