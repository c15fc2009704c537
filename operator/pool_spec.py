"""The spec's worker pools (spec.pools): a pool's pods, its instance types, and the
shared-GPU option (sharedGpu: an EP and a D instance per pod under MPS)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from triptych.kube import names
from triptych.operator.spec_base import (
    DNS_LABEL,
    Model,
    Opaque,
    PullPolicy,
    Quantity,
    ResourceRequirements,
    Toleration,
)
from triptych.topology import STAGE_TYPES, InstanceType

GPU = "nvidia.com/gpu"


class EnvVar(Model):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: Opaque | None = None


class Volume(Model):
    """A pod volume: `name` plus any Kubernetes volume source."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=DNS_LABEL, max_length=63)


class VolumeMount(Model):
    name: str
    mount_path: str
    read_only: bool | None = None
    sub_path: str | None = None


def _worker_resources() -> ResourceRequirements:
    return ResourceRequirements(requests={"cpu": "1", "memory": "4Gi"}, limits={"memory": "4Gi"})


class SharedGPU(Model):
    """Shared-GPU co-location (UnifiedServe §4.1, §4.4): each pod of the pool runs an EP
    instance (encode + prefill, scheduled together in one process) and a D instance (a
    separate process) as two containers on the pod's one GPU, under NVIDIA MPS (an MPS
    control daemon in a sidecar; the pipe and log directories on a shared emptyDir). The
    EP instance's encode and prefill token budgets (UnifiedServe §4.5, Algorithm 3: alpha
    and tau) bound how much compute each of its iterations takes, and so the decode's
    interference."""

    mode: Literal["MPS"] = "MPS"
    encode_token_budget: int = Field(
        2048, ge=1, description="alpha of UnifiedServe Alg. 3: vision-encoder tokens (patch tokens after "
        "merging) an EP iteration admits; at least one image always runs")
    prefill_token_budget: int = Field(512, ge=1, description="tau of UnifiedServe Alg. 3: prefill tokens "
                                      "per EP iteration")
    decode_port: int = Field(names.WORKER_PORT + 1, ge=1, le=65535,
                             description="the D container's port (the EP container uses the pool's port)")
    encode_prefill_thread_percentage: int | None = Field(
        None, ge=1, le=100, description="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the EP container")
    decode_thread_percentage: int | None = Field(
        None, ge=1, le=100, description="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the D container")
    mps_image: str | None = Field(None, description="image with nvidia-cuda-mps-control for the MPS daemon "
                                  "sidecar (default: the pool's image)")


class WorkerPool(Model):
    """A group of identical worker pods (one Deployment); the operator gives each pod one of
    the pool's instance types as its role. A pool of V (video decoder) pods allows V only:
    they start as V (`--role V`), load no model weights and never switch roles."""

    name: str = Field(pattern=DNS_LABEL, max_length=30)
    instance_types: list[InstanceType] = Field(
        default_factory=lambda: list(STAGE_TYPES), min_length=1,
        description="instance types this pool's pods may serve (default: every E/P/D type; V needs a "
                    "pool of its own)",
        json_schema_extra={"x-kubernetes-list-type": "set"})
    image: str = names.DEFAULT_IMAGE
    image_pull_policy: PullPolicy = "IfNotPresent"
    port: int = Field(names.WORKER_PORT, ge=1, le=65535)
    resources: ResourceRequirements = Field(default_factory=_worker_resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: Opaque | None = None
    env: list[EnvVar] = Field(default_factory=list)
    volumes: list[Volume] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    shm_size: Quantity = "1Gi"
    shared_gpu: SharedGPU | None = Field(
        None, description="run an EP and a D instance per pod on one GPU under MPS (instanceTypes must be "
        "[EP, D], topology EP = D for this pool)")
    # >= 1: a budget of 0 would block every node drain forever.
    max_unavailable: int = Field(1, ge=1, description="PodDisruptionBudget maxUnavailable (at least 1)")

    @property
    def uses_gpu(self) -> bool:
        return GPU in self.resources.limits or GPU in self.resources.requests

    @property
    def video_only(self) -> bool:
        """A pool of V pods: started as V, never switched (worker/video_instance.py)."""
        return self.instance_types == [InstanceType.V]


    @property
    def colocated(self) -> bool:
        """Each pod runs an EP and a D worker (shared_gpu): fixed roles, never switched."""
        return self.shared_gpu is not None


# The two instance types of a shared-GPU pod, in container order (the pod's label is the first).
COLOCATED_TYPES = (InstanceType.EP, InstanceType.D)


def pool_replicas(pool: WorkerPool, counts: dict[InstanceType, int]) -> int:
    """Pods of a pool: one per instance, or one per EP + D pair on a shared-GPU pool."""
    return counts.get(InstanceType.EP, 0) if pool.colocated else sum(counts.values())


def default_video_pool() -> WorkerPool:
    """The pool V instances get when spec.pools is empty: CPU only (PyAV), no GPU."""
    return WorkerPool(name="video", instance_types=[InstanceType.V],
                      resources=ResourceRequirements(requests={"cpu": "2", "memory": "2Gi"},
                                                     limits={"memory": "4Gi"}))
