"""The status an MLLMDeployment should show, computed from what the operator observed. Pure.

Conditions (Kubernetes conventions: a condition keeps its lastTransitionTime while its
status stays the same):
  Ready        True when every instance type has its desired count of ready pods in that
               role and the router has a ready replica; reasons AllInstancesReady,
               InstancesNotReady, RouterNotReady, InvalidSpec.
  Progressing  True while roles are being assigned, pods are starting or being removed
               (Reconciling); False when settled (Stable) or the spec is invalid.
  Degraded     True when a worker refused or missed a role switch (RoleAssignmentFailed);
               False otherwise (AsExpected).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triptych.operator.roles import TYPE_ORDER, PoolPlan, WorkerPod
from triptych.topology import UNASSIGNED, InstanceType, format_topology

Obj = dict[str, Any]


@dataclass(frozen=True)
class Observation:
    generation: int | None
    pool_counts: Mapping[str, Mapping[InstanceType, int]] = field(default_factory=dict)
    pods: Mapping[str, list[WorkerPod]] = field(default_factory=dict)  # pool -> pods, roles as now
    router_ready: int = 0
    plans: Mapping[str, PoolPlan] = field(default_factory=dict)  # what is left to do after this pass
    failures: tuple[str, ...] = ()
    invalid: tuple[str, ...] = ()  # InvalidSpec problems; everything else is ignored when set
    colocated: frozenset[str] = frozenset()  # shared-GPU pools: a ready EP pod is a ready D too


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int | None) -> Obj:
    cond = {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def compute_status(obs: Observation, old: Mapping[str, Any] | None, now: str) -> Obj:
    old = old or {}
    if obs.invalid:
        message = "; ".join(obs.invalid)
        conditions = [_condition("Ready", False, "InvalidSpec", message, obs.generation),
                      _condition("Progressing", False, "InvalidSpec", "fix the spec to continue", obs.generation),
                      _condition("Degraded", False, "AsExpected", "", obs.generation)]
        status = {k: v for k, v in old.items() if k not in ("conditions", "observedGeneration")}
    else:
        status, conditions = _serving_status(obs)
        if "plan" in old:  # the planner's (operator/planner/k8s_connector.py), not ours to drop
            status["plan"] = old["plan"]
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    status["conditions"] = _carry_transition_times(conditions, old.get("conditions", []), now)
    return status


def _serving_status(obs: Observation) -> tuple[Obj, list[Obj]]:
    desired: dict[InstanceType, int] = {}
    for counts in obs.pool_counts.values():
        for kind, n in counts.items():
            desired[kind] = desired.get(kind, 0) + n
    ready: dict[InstanceType, int] = {}
    workers = []
    for pool, pods in sorted(obs.pods.items()):
        for pod in pods:
            if pod.terminating:
                continue
            if pod.role is not None and pod.ready:
                ready[pod.role] = ready.get(pod.role, 0) + 1
                if pool in obs.colocated and pod.role is InstanceType.EP:  # its D container is ready too
                    ready[InstanceType.D] = ready.get(InstanceType.D, 0) + 1
            workers.append({"name": pod.name, "pool": pool,
                            "role": pod.role.value if pod.role else UNASSIGNED, "ready": pod.ready})
    kinds = [t for t in TYPE_ORDER if desired.get(t) or ready.get(t)]
    short = [f"{t.value} {min(ready.get(t, 0), desired.get(t, 0))}/{desired.get(t, 0)}"
             for t in kinds if ready.get(t, 0) < desired.get(t, 0)]
    total_desired = sum(desired.values())
    total_ready = sum(min(ready.get(t, 0), n) for t, n in desired.items())
    status: Obj = {
        "topology": format_topology(desired),
        "instances": f"{total_ready}/{total_desired}",
        "instanceTypes": {t.value: {"desired": desired.get(t, 0), "ready": ready.get(t, 0)} for t in kinds},
        "workers": sorted(workers, key=lambda w: w["name"]),
    }
    g = obs.generation
    if short:
        ready_cond = _condition("Ready", False, "InstancesNotReady", "ready/desired: " + ", ".join(short), g)
    elif obs.router_ready < 1:
        ready_cond = _condition("Ready", False, "RouterNotReady", "no router replica is ready", g)
    else:
        ready_cond = _condition("Ready", True, "AllInstancesReady", f"{total_ready} instances ready", g)
    pending = [f"{pool}: {_describe(plan)}" for pool, plan in sorted(obs.plans.items()) if not plan.settled]
    progressing = (_condition("Progressing", True, "Reconciling", "; ".join(pending), g) if pending
                   else _condition("Progressing", False, "Stable", "roles match the topology", g))
    degraded = (_condition("Degraded", True, "RoleAssignmentFailed", "; ".join(obs.failures), g)
                if obs.failures else _condition("Degraded", False, "AsExpected", "", g))
    return status, [ready_cond, progressing, degraded]


def _describe(plan: PoolPlan) -> str:
    parts = []
    if plan.changes:
        parts.append(f"{len(plan.changes)} role change(s)")
    if plan.remove or plan.excess:
        parts.append(f"{max(len(plan.remove), plan.excess)} pod(s) to remove")
    if plan.waiting:
        parts.append(f"{plan.waiting} instance(s) waiting for pods")
    return ", ".join(parts)


def _carry_transition_times(new: list[Obj], old: list[Obj], now: str) -> list[Obj]:
    previous = {c.get("type"): c for c in old}
    out = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        out.append({**cond, "lastTransitionTime": before.get("lastTransitionTime", now) if same else now})
    return out


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> Obj:
    """The RFC 7386 merge patch turning `old` into `new` (empty when equal)."""
    patch: Obj = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif before != value or key not in old:
            patch[key] = value
    return patch


def transition(old: Mapping[str, Any] | None, new: Mapping[str, Any], kind: str) -> Obj | None:
    """The new condition of `kind` if its status, reason or message changed, else None."""
    def find(status: Mapping[str, Any] | None) -> Obj | None:
        return next((c for c in (status or {}).get("conditions", []) if c.get("type") == kind), None)
    before, after = find(old), find(new)
    if after is None:
        return None
    if before and all(before.get(k) == after.get(k) for k in ("status", "reason", "message")):
        return None
    return after
