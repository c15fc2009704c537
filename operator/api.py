"""The MLLMDeployment spec as pydantic models: the one definition of the CRD schema.

`triptych crd` renders these models into `crds/mllmdeployment.yaml` (see crd.py); the
operator parses every resource it handles with them (`parse_spec`). Field names are
camelCase on the wire. Rules that one field's schema cannot express (an instance type
that no pool allows, a fixed budget without a value...) live in `spec_problems` and make
the resource Ready=False with reason InvalidSpec instead of creating anything.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from triptych.kube import names
from triptych.operator.pool_spec import COLOCATED_TYPES, GPU, WorkerPool, default_video_pool
from triptych.operator.safety import safety_problems
from triptych.operator.spec_base import Model, Opaque, PullPolicy, ResourceRequirements, Toleration
from triptych.topology import InstanceType, TopologyError, format_topology, validate_coverage

Family = Literal["qwen2-vl", "qwen2.5-vl", "llava"]
Dtype = Literal["float32", "float16", "bfloat16"]


class ModelSource(Model):
    """Where the checkpoint is: a path inside the image, a path on a PVC or on any volume
    (mounted read-only at /models), or tiny: a random-weight demo checkpoint built at pod
    start (CPU demos and tests)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "[has(self.pvc), has(self.volume), has(self.tiny)].filter(x, x).size() <= 1",
        "message": "set at most one of pvc, volume, tiny",
    }]})

    path: str | None = Field(None, description="checkpoint directory: relative to the volume when pvc or "
                             "volume is set, else an absolute path inside the image")
    pvc: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description="PVC name")
    volume: Opaque | None = Field(None, description="a Kubernetes volume source, e.g. {csi: {...}} (allowed types: operator/safety.py)")
    tiny: Family | None = Field(None, description="build a tiny random-weight checkpoint of this family")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        kinds = [k for k in ("pvc", "volume", "tiny") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"set at most one of pvc, volume, tiny (got {', '.join(kinds)})")
        if self.tiny is None and not self.path:
            raise ValueError("path is required unless tiny is set")
        if not kinds and self.path and not self.path.startswith("/"):
            raise ValueError("path must be absolute when no pvc or volume is given")
        return self


class ModelConfig(Model):
    source: ModelSource
    served_model_name: str | None = Field(None, description="name in /v1/models (default: metadata.name)")
    family: Family | None = Field(None, description="override the family read from config.json")
    dtype: Dtype = "bfloat16"
    max_model_len: int | None = Field(None, ge=1)


def _router_resources() -> ResourceRequirements:
    return ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "2Gi"})


class SecretKeyRef(Model):
    name: str
    key: str = "api-keys"


class RouterSpec(Model):
    replicas: int = Field(1, ge=1)
    image: str = names.DEFAULT_IMAGE
    image_pull_policy: PullPolicy = "IfNotPresent"
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(names.ROUTER_PORT, ge=1, le=65535)
    api_keys_secret_ref: SecretKeyRef | None = Field(None, description="Secret key holding one API key per line")
    resources: ResourceRequirements = Field(default_factory=_router_resources)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    allow_unauthenticated: bool = Field(False, description="serve a NodePort/LoadBalancer router without "
                                        "apiKeysSecretRef (refused unless set)")


class UCXConfig(Model):
    tls: str | None = Field(None, description="UCX_TLS, e.g. 'rc,cuda_copy,cuda_ipc'")
    net_devices: str | None = Field(None, description="UCX_NET_DEVICES, e.g. 'mlx5_0:1'")
    env: dict[str, str] = Field(default_factory=dict, description="extra UCX_* variables")


class TransferConfig(Model):
    backend: Literal["nixl"] = "nixl"
    require_rdma: bool = Field(False, description="exclude TCP from UCX transports (UCX_TLS=^tcp unless ucx.tls)")
    allow_fallback: bool = Field(False, description="let workers fall back to a non-NIXL transport "
                                 "(a warning and a metric label, never silent)")
    ucx: UCXConfig = Field(default_factory=UCXConfig)


class SLOConfig(Model):
    ttft_ms: int = Field(2000, ge=1)
    tbt_ms: int = Field(200, ge=1)
    attainment_target: float = Field(0.9, gt=0, le=1)


class SchedulingConfig(Model):
    budgets: Literal["FromSLO", "Fixed"] = Field(
        "FromSLO", description="FromSLO: workers profile budgets from the SLO at start-up (TriInfer Alg. 1)")
    token_budget: int | None = Field(None, ge=1)
    image_budget: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1, le=1024)


class InstanceLimits(Model):
    min: int = Field(0, ge=0)
    max: int = Field(ge=1)


class ReplanProfileSource(Model):
    """Step times for the planner's replans (TriInfer Alg. 2 in the simulator): a ConfigMap
    in the deployment's namespace holding a profile `triptych profile` measured on the
    serving GPUs (key `profileKey`), or, with `gpu`, the checkpoint's config.json (key
    `configKey`, and its preprocessor_config.json if present) for HydraInfer Table 2's
    roofline on that GPU."""

    config_map: str = Field(..., min_length=1, max_length=253, description="the ConfigMap's name")
    profile_key: str = Field("profile.json", description="key of a measured profile (`triptych profile --out`)")
    config_key: str = Field("config.json", description="key of the model's config.json (with gpu)")
    preprocessor_key: str = Field("preprocessor_config.json", description="key of the model's "
                                  "preprocessor_config.json (with gpu; optional: image patching defaults)")
    gpu: Literal["H100", "H200", "A100", "L40S"] | None = Field(
        None, description="without a measured profile: the roofline of this GPU")


class AutoscalingConfig(Model):
    """Bounds and pacing for the planner (operator/planner/, docs/planner.md). While enabled,
    the planner owns spec.topology's counts (as an HPA owns a Deployment's replicas)."""

    enabled: bool = False
    dry_run: bool = Field(False, description="decide and record (Events, status.plan) but change nothing")
    interval_seconds: int = Field(15, ge=1, description="seconds between snapshots and decisions")
    limits: dict[InstanceType, InstanceLimits] = Field(default_factory=dict)
    role_switching: bool = True
    encoder_scaling: bool = Field(True, description="add or remove E instances on encode queueing")
    replan_interval_seconds: int = Field(300, ge=10)
    replan_gain: float = Field(1.1, ge=1.0, description="predicted goodput ratio a replan needs to move")
    replan_profile: ReplanProfileSource | None = Field(
        None, description="step times the replans simulate with; without it the planner does not replan "
        "(the reactive, encoder, decode and video rules still run)")
    prometheus_url: str | None = Field(None, pattern=r"^https?://")
    scale_up_cooldown_seconds: int = Field(60, ge=0)
    scale_down_cooldown_seconds: int = Field(300, ge=0)
    role_switch_cooldown_seconds: int = Field(120, ge=0)
    sustain: int = Field(3, ge=1, description="consecutive snapshots a trigger must hold")
    max_queue_per_instance: float = Field(16.0, gt=0, description="queued requests that fill one instance")
    divergence_on: float = Field(0.5, gt=0, description="queue-fill spread between types that triggers a move")
    divergence_off: float = Field(0.25, ge=0, description="spread under which a triggered move resets")
    encode_up: float = Field(8.0, gt=0, description="queued images per E instance that add one")
    encode_down: float = Field(1.0, ge=0, description="queued images per E instance that remove one")
    decode_scaling: bool = Field(True, description="lend an instance to D under decode pressure (TBT p90 vs "
                                 "spec.slo.tbtMs, decode seats and KV in use) and give it back after")
    decode_up: float = Field(1.0, gt=0, description="TBT p90 / TBT SLO at which decode is under pressure")
    decode_down: float = Field(0.5, ge=0, description="TBT p90 / TBT SLO (with one D fewer) under which "
                               "a lent instance goes back")
    video_scaling: bool = Field(True, description="add or remove V instances on queued video GOP sets")
    video_up: float = Field(8.0, gt=0, description="queued GOP sets per V instance that add one")
    video_down: float = Field(0.5, ge=0, description="queued GOP sets per V instance that remove one")


class NetworkPolicyConfig(Model):
    enabled: bool = True
    additional_ingress: list[Opaque] = Field(
        default_factory=list, description="extra NetworkPolicyPeers allowed to reach the workers' http port")
    additional_egress: list[Opaque] = Field(
        default_factory=list, description="extra NetworkPolicyPeers workers may connect to (besides their "
        "peers and DNS)")


def _default_scrapers() -> list[dict[str, Any]]:
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


class MonitoringConfig(Model):
    service_monitor: bool = Field(True, description="monitoring on: create a ServiceMonitor when its CRD is "
                                  "installed and let `scrapers` reach the workers' /metrics")
    scrapers: list[Opaque] = Field(
        default_factory=_default_scrapers, description="NetworkPolicyPeers allowed to scrape the workers "
        "(default: pods app.kubernetes.io/name=prometheus in namespace monitoring)")
    interval: str = Field("30s", pattern=r"^[0-9]+(ms|s|m|h)$")


class MLLMDeploymentSpec(Model):
    """A multimodal LLM served with Encode/Prefill/Decode disaggregation."""

    model: ModelConfig
    topology: dict[InstanceType, Annotated[int, Field(ge=0)]] = Field(
        min_length=1, description="instances per instance type, e.g. {E: 2, P: 1, D: 3}")
    pools: list[WorkerPool] = Field(
        default_factory=list, description="worker pools (default: one pool 'workers' allowing every type)",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    router: RouterSpec = Field(default_factory=RouterSpec)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    network_policy: NetworkPolicyConfig = Field(default_factory=NetworkPolicyConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)

    def effective_pools(self) -> list[WorkerPool]:
        if self.pools:
            return self.pools
        video = [default_video_pool()] if self.topology.get(InstanceType.V, 0) > 0 else []
        return [WorkerPool(name="workers"), *video]

    def counts(self) -> dict[InstanceType, int]:
        return {t: n for t, n in self.topology.items() if n > 0}


class Condition(Model):
    type: Literal["Ready", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = None


class InstanceCounts(Model):
    desired: int = 0
    ready: int = 0


class WorkerStatus(Model):
    name: str
    pool: str
    role: str = Field(description="instance type, or 'unassigned'")
    ready: bool = False


class MLLMDeploymentStatus(Model):
    """Written by the operator through the status subresource."""

    observed_generation: int | None = None
    topology: str | None = Field(None, description="desired topology, e.g. 1E1P2D")
    instances: str | None = Field(None, description="ready/desired instances, e.g. 3/4")
    instance_types: dict[InstanceType, InstanceCounts] = Field(default_factory=dict)
    workers: list[WorkerStatus] = Field(
        default_factory=list, description="each worker pod and its current role",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    plan: Opaque | None = Field(None, description="the planner's last decisions and why (planner/driver.py "
                                "PlanDocument); written by the planner, kept by reconcile passes")


class InvalidSpecError(ValueError):
    """The resource's spec cannot be served; `problems` are readable one-line messages."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def _loc(loc: tuple[Any, ...]) -> str:
    out = "spec"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def parse_spec(raw: dict[str, Any] | None, *, name: str = "x") -> MLLMDeploymentSpec:
    """Validate a resource's spec: schema rules first, then the cross-field rules."""
    try:
        spec = MLLMDeploymentSpec.model_validate(raw or {})
    except ValidationError as e:
        raise InvalidSpecError([f"{_loc(err['loc'])}: {err['msg']}" for err in e.errors()]) from None
    problems = spec_problems(spec, name=name)
    if problems:
        raise InvalidSpecError(problems)
    return spec


def pool_assignment(spec: MLLMDeploymentSpec) -> dict[str, dict[InstanceType, int]]:
    """Instances per pool: each instance type goes to the first pool that allows it."""
    pools = spec.effective_pools()
    plan: dict[str, dict[InstanceType, int]] = {p.name: {} for p in pools}
    for kind, count in spec.counts().items():
        for pool in pools:
            if kind in pool.instance_types:
                plan[pool.name][kind] = count
                break
    return plan


def spec_problems(spec: MLLMDeploymentSpec, *, name: str) -> list[str]:
    """Cross-field rules; an empty list means the spec can be served."""
    problems: list[str] = []
    counts = spec.counts()
    pools = spec.effective_pools()
    if not counts:
        problems.append("spec.topology: no instances (every count is 0)")
    else:
        try:
            validate_coverage(counts)
        except TopologyError as e:
            problems.append(f"spec.topology: {e}")
    seen: set[str] = set()
    for pool in pools:
        if pool.name in seen:
            problems.append(f"spec.pools: duplicate pool name {pool.name!r}")
        seen.add(pool.name)
        if GPU in pool.resources.requests and pool.resources.requests[GPU] != pool.resources.limits.get(GPU):
            problems.append(f"spec.pools[{pool.name}].resources: {GPU} requests must equal limits")
        if InstanceType.V in pool.instance_types and not pool.video_only:
            problems.append(f"spec.pools[{pool.name}].instanceTypes: V (video decode, no model weights, never "
                            "switched) needs a pool of its own")
        problems += _shared_gpu_problems(spec, pool)
        if len(names.worker_deployment_name(name, pool.name)) > 63:
            problems.append(f"name {name!r} + pool {pool.name!r} is longer than 63 characters")
    allowed = {t for p in pools for t in p.instance_types}
    for kind in counts:
        if kind not in allowed:
            problems.append(f"spec.topology.{kind.value}: no pool allows instance type {kind.value} "
                            f"(pools: {', '.join(f'{p.name}={[t.value for t in p.instance_types]}' for p in pools)})")
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) or len(names.workers_service_name(name)) > 63:
        problems.append(f"name {name!r} must be a DNS label (start with a letter) of at most 55 characters")
    sched = spec.scheduling
    if sched.budgets == "Fixed" and (sched.token_budget is None or sched.image_budget is None):
        problems.append("spec.scheduling: budgets=Fixed needs tokenBudget and imageBudget")
    problems += _autoscaling_problems(spec)
    problems += safety_problems(spec)
    return problems


def _shared_gpu_problems(spec: MLLMDeploymentSpec, pool: WorkerPool) -> list[str]:
    if pool.shared_gpu is None:
        return []
    where = f"spec.pools[{pool.name}]"
    problems = []
    if sorted(pool.instance_types) != sorted(COLOCATED_TYPES):
        problems.append(f"{where}.sharedGpu: instanceTypes must be [EP, D] (one of each per pod)")
    counts = pool_assignment(spec).get(pool.name, {})
    if counts.get(InstanceType.EP, 0) != counts.get(InstanceType.D, 0):
        problems.append(f"{where}.sharedGpu: the pool runs EP and D in pairs; topology gives it "
                        f"EP={counts.get(InstanceType.EP, 0)} D={counts.get(InstanceType.D, 0)}")
    if pool.shared_gpu.decode_port == pool.port:
        problems.append(f"{where}.sharedGpu.decodePort: must differ from the pool's port {pool.port}")
    if not pool.uses_gpu:
        problems.append(f"{where}.sharedGpu: needs {GPU} in resources (MPS shares one GPU)")
    if spec.autoscaling.enabled:
        problems.append(f"{where}.sharedGpu: autoscaling does not move instances of shared-GPU pods")
    return problems


def _autoscaling_problems(spec: MLLMDeploymentSpec) -> list[str]:
    auto = spec.autoscaling
    problems = []
    for kind, lim in auto.limits.items():
        if lim.min > lim.max:
            problems.append(f"spec.autoscaling.limits.{kind.value}: min {lim.min} > max {lim.max}")
        count = spec.topology.get(kind, 0)
        if auto.enabled and not lim.min <= count <= lim.max:
            problems.append(f"spec.topology.{kind.value}={count} is outside autoscaling limits "
                            f"[{lim.min}, {lim.max}]")
    if auto.enabled and not auto.prometheus_url:
        problems.append("spec.autoscaling: enabled needs prometheusUrl")
    return problems


def topology_string(spec: MLLMDeploymentSpec) -> str:
    return format_topology(spec.counts())
