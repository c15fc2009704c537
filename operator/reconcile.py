"""One reconcile pass over an MLLMDeployment: the I/O around the pure functions.

Order matters:
  1. validate the spec, then every rendered child offline against the Kubernetes schemas
     (validation.py; invalid: status InvalidSpec + Event, nothing else is touched);
  2. make sure the deployment's tokens Secret exists (tokens.py; created once, never rewritten);
  3. ask every worker's /health which role it serves; a pod whose label claims another role
     (its container restarted: it is unassigned again) is relabelled to what it serves, so
     the plan re-assigns it and the status is not Ready meanwhile;
  4. plan roles per pool from the live pods (roles.plan_pool);
  5. mark pods to remove with a low deletion cost - before the replica count drops;
  6. apply child objects that are missing, changed in the spec (hash) or edited by hand
     (drift.py), prune children no longer desired;
  7. switch roles: worker admin endpoint (with the admin token) first, then the pod's labels;
  8. write the status if it changed (merge patch on the status subresource).
Every write is skipped when the object already says what we would write, so a pass over a
settled deployment (e.g. after an operator restart) makes no writes at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Mapping
from typing import Any

from triptych.kube import names
from triptych.kube.client import (
    CONFIG_MAP,
    DEPLOYMENT,
    MLLM,
    NETWORK_POLICY,
    PDB,
    POD,
    ROLE,
    ROLE_BINDING,
    SERVICE,
    SERVICE_ACCOUNT,
    SERVICE_MONITOR,
    Kind,
    matches,
)
from triptych.operator.api import InvalidSpecError, parse_spec
from triptych.operator.context import OperatorContext
from triptych.operator.desired import Desired, Owner, desired_objects
from triptych.operator.drift import differences
from triptych.operator.roles import PoolPlan, RoleChange, WorkerPod, plan_pool, role_labels
from triptych.operator.status import Observation, compute_status, merge_patch, transition
from triptych.operator.tokens import ensure_tokens
from triptych.operator.validation import invalid_objects
from triptych.operator.workers import RoleSwitchError, WorkerHealth
from triptych.topology import UNASSIGNED, InstanceType

logger = logging.getLogger(__name__)
Obj = dict[str, Any]

# Children in apply order (config and identity before the pods that use them). Prunable
# kinds are the ones whose set of objects changes with the spec (pools, toggles).
CHILD_KINDS: tuple[Kind, ...] = (CONFIG_MAP, SERVICE_ACCOUNT, ROLE, ROLE_BINDING, SERVICE, DEPLOYMENT, PDB,
                                 NETWORK_POLICY, SERVICE_MONITOR)
PRUNABLE: frozenset[str] = frozenset({"Deployment", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"})


async def reconcile(ctx: OperatorContext, namespace: str, name: str, *, apply_children: bool) -> None:
    """One pass over the deployment `namespace/name`, read fresh under its lock (a handler's
    body may predate this process's own last status write)."""
    pass_kind = "full" if apply_children else "roles"
    queued = ctx.queued_passes(namespace, name)
    if pass_kind in queued or "full" in queued:
        return  # a pass that has not started yet reads the state after this event anyway
    queued.add(pass_kind)
    async with ctx.lock(namespace, name):
        queued.discard(pass_kind)
        body = await ctx.kube.get(MLLM, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # owner references let the garbage collector remove the children
        await _reconcile_locked(ctx, body, apply_children=apply_children)


async def _reconcile_locked(ctx: OperatorContext, body: Mapping[str, Any], *, apply_children: bool) -> None:
    meta = body["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except InvalidSpecError as e:
        await _write_status(ctx, body, Observation(generation, invalid=tuple(e.problems)))
        return
    owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
    desired = desired_objects(owner, spec, await ctx.facts())
    # Off the event loop: a first check of a new spec takes ~0.5 s (schemas load, then cached).
    refused = await asyncio.to_thread(invalid_objects, desired.objects)
    if refused:  # the API server would refuse these: apply nothing rather than half the deployment
        await _write_status(ctx, body, Observation(generation, invalid=tuple(refused)))
        return
    token, created = await ensure_tokens(ctx.kube, owner)
    if created:
        ctx.emit(body, "Normal", "TokensCreated", f"Secret {names.tokens_secret_name(name)}")

    raw_pods = await ctx.kube.list(POD, namespace, names.worker_selector(name))
    health = await _worker_health(ctx, raw_pods, token)
    await _relabel_drifted(ctx, body, raw_pods, health)
    pods = {pool: [worker_pod(p, health.get(p["metadata"]["name"])) for p in raw_pods if _pool_of(p) == pool]
            for pool in desired.pool_counts}
    plans = {pool: plan_pool(desired.role_counts(pool), pods[pool]) for pool in desired.pool_counts}

    await _mark_removals(ctx, body, plans)
    listed = await _apply_children(ctx, body, owner, desired) if apply_children else {}
    done, failures = await _change_roles(ctx, body, plans, {p["metadata"]["name"]: p for p in raw_pods}, token)

    marked = {pod for plan in plans.values() for pod in plan.remove}
    unmarked = {pod for plan in plans.values() for pod in plan.unmark}
    current = {pool: [_after(p, done.get(p.name), marked, unmarked) for p in pool_pods]
               for pool, pool_pods in pods.items()}
    left = {pool: plan_pool(desired.role_counts(pool), current[pool]) for pool in current}
    router_labels = {names.LABEL_DEPLOYMENT: name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    if "Deployment" in listed:  # the status of the router Deployment, as listed before applying
        routers = [d for d in listed["Deployment"] if matches(d, router_labels)]
    else:
        routers = await ctx.kube.list(DEPLOYMENT, namespace, router_labels)
    router_ready = sum((d.get("status") or {}).get("readyReplicas") or 0 for d in routers)
    observation = Observation(generation, desired.pool_counts, current, router_ready, left, tuple(failures),
                              colocated=desired.colocated)
    await _write_status(ctx, body, observation)


# --- pods ----------------------------------------------------------------------------------

def _pool_of(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("metadata", {}).get("labels") or {}).get(names.LABEL_POOL)


def _label_role(pod: Mapping[str, Any]) -> InstanceType | None:
    label = (pod.get("metadata", {}).get("labels") or {}).get(names.LABEL_ROLE)
    return InstanceType(label) if label in InstanceType.__members__ else None


def served_role(health: WorkerHealth | None, label: InstanceType | None) -> InstanceType | None:
    """The role a worker serves: what its /health reports, else (no answer, or a role name
    this operator does not know) what its label says."""
    if health is None:
        return label
    if health.role == UNASSIGNED:
        return None
    return InstanceType(health.role) if health.role in InstanceType.__members__ else label


def worker_pod(pod: Mapping[str, Any], health: WorkerHealth | None = None) -> WorkerPod:
    """The planner's view of a pod object (and of its worker's /health answer)."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    marked = (meta.get("annotations") or {}).get(names.ANNOTATION_DELETION_COST) == names.REMOVAL_DELETION_COST
    return WorkerPod(name=meta["name"], role=served_role(health, _label_role(pod)), ready=ready,
                     ip=status.get("podIP"), created=meta.get("creationTimestamp") or "",
                     terminating=bool(meta.get("deletionTimestamp")), marked=marked,
                     up=health is not None and health.up)


async def _worker_health(ctx: OperatorContext, raw_pods: list[Obj], token: str | None) -> dict[str, WorkerHealth]:
    """/health of every running worker, concurrently (each bounded by workers.HEALTH_TIMEOUT_S)."""
    live = [p for p in raw_pods if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")]
    answers = await asyncio.gather(*(ctx.workers.health(p["status"]["podIP"], _pod_port(p), token) for p in live))
    return {p["metadata"]["name"]: h for p, h in zip(live, answers, strict=True) if h is not None}


async def _relabel_drifted(ctx: OperatorContext, body: Mapping[str, Any], raw_pods: list[Obj],
                           health: Mapping[str, WorkerHealth]) -> None:
    """Make each pod's role label say what its worker serves (a restarted container comes back
    unassigned under its old label); the plan then gives the role to a pod again."""
    for pod in raw_pods:
        name = pod["metadata"]["name"]
        label = _label_role(pod)
        served = served_role(health.get(name), label)
        if served == label:
            continue
        await ctx.kube.patch(POD, body["metadata"]["namespace"], name, {"metadata": {"labels": role_labels(served)}})
        # A V pod starts as V (--role V), a shared-GPU pod's first worker as EP: nothing drifted.
        if label is None and _fixed_role(pod, served):
            ctx.emit(body, "Normal", "RoleAssigned", f"{name}: unassigned -> {served.value if served else UNASSIGNED}")
            continue
        ctx.emit(body, "Warning", "RoleDrift", f"{name}: labelled {label.value if label else UNASSIGNED} but its "
                 f"worker serves {served.value if served else UNASSIGNED} (restarted?); relabelled")


def _fixed_role(pod: Mapping[str, Any], served: InstanceType | None) -> bool:
    """The worker started in the role it serves: a V pod (--role V), or the EP worker of a
    shared-GPU pod (annotated with its workers)."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    return served is InstanceType.V or (served is InstanceType.EP and names.ANNOTATION_WORKERS in annotations)


def _after(pod: WorkerPod, role: InstanceType | None, marked: set[str], unmarked: set[str]) -> WorkerPod:
    """The pod as this pass left it (new role, removal mark)."""
    mark = (pod.marked or pod.name in marked) and pod.name not in unmarked
    return dataclasses.replace(pod, role=role or pod.role, marked=mark)


def _pod_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == names.PORT_NAME:
                return int(port["containerPort"])
    return names.WORKER_PORT


async def _mark_removals(ctx: OperatorContext, body: Mapping[str, Any], plans: Mapping[str, PoolPlan]) -> None:
    namespace = body["metadata"]["namespace"]
    marked = []
    for plan in plans.values():
        for pod in plan.remove:
            await ctx.kube.patch(POD, namespace, pod, {"metadata": {"annotations": {
                names.ANNOTATION_DELETION_COST: names.REMOVAL_DELETION_COST}}})
            marked.append(pod)
        for pod in plan.unmark:
            await ctx.kube.patch(POD, namespace, pod, {"metadata": {"annotations": {
                names.ANNOTATION_DELETION_COST: None}}})
    if marked:
        ctx.emit(body, "Normal", "ScaleDown", f"marked for removal: {', '.join(marked)}")


async def _change_roles(ctx: OperatorContext, body: Mapping[str, Any], plans: Mapping[str, PoolPlan],
                        raw_pods: Mapping[str, Mapping[str, Any]],
                        token: str | None) -> tuple[dict[str, InstanceType], list[str]]:
    changes = [c for plan in plans.values() for c in plan.changes]
    results = await asyncio.gather(*(_change_role(ctx, body, c, raw_pods[c.pod], token) for c in changes))
    done = {c.pod: c.new for c, error in zip(changes, results, strict=True) if error is None}
    return done, [e for e in results if e is not None]


async def _change_role(ctx: OperatorContext, body: Mapping[str, Any], change: RoleChange,
                       pod: Mapping[str, Any], token: str | None) -> str | None:
    """Switch one worker, then relabel its pod; returns an error message or None."""
    namespace = body["metadata"]["namespace"]
    old = change.old.value if change.old else "unassigned"
    try:
        await ctx.workers.set_role(pod["status"]["podIP"], _pod_port(pod), change.new, token)
    except RoleSwitchError as e:
        message = f"{change.pod}: {old} -> {change.new.value} failed: {e}"
        ctx.emit(body, "Warning", "RoleAssignmentFailed", message)
        return message
    await ctx.kube.patch(POD, namespace, change.pod, {"metadata": {"labels": role_labels(change.new)}})
    ctx.emit(body, "Normal", "RoleAssigned", f"{change.pod}: {old} -> {change.new.value}")
    return None


# --- children ------------------------------------------------------------------------------

def _hash(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH)


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


async def _apply_children(ctx: OperatorContext, body: Mapping[str, Any], owner: Owner,
                          desired: Desired) -> dict[str, list[Obj]]:
    """Apply what changed, prune what is no longer desired; returns the listed children by kind."""
    facts = await ctx.facts()
    kinds = [k for k in CHILD_KINDS if k is not SERVICE_MONITOR or facts.service_monitor_crd]
    selector = {names.LABEL_DEPLOYMENT: owner.name}
    listed = await asyncio.gather(*(ctx.kube.list(k, owner.namespace, selector) for k in kinds))
    applied, corrected, pruned = [], [], []
    for kind, objs in zip(kinds, listed, strict=True):
        want = desired.by_kind(kind.kind)
        have = {o["metadata"]["name"]: o for o in objs}
        for name, obj in want.items():
            if name not in have or _hash(have[name]) != _hash(obj):
                await ctx.kube.apply(obj)
                applied.append(f"{kind.kind} {name}")
            elif drift := differences(obj, have[name]):  # edited by hand: put it back
                await ctx.kube.apply(obj)
                corrected.append(f"{kind.kind} {name} ({', '.join(drift[:3])}{', ...' if len(drift) > 3 else ''})")
        if kind.kind in PRUNABLE:
            for name, obj in have.items():
                if name not in want and _owned_by(obj, owner.uid):
                    await ctx.kube.delete(kind, owner.namespace, name)
                    pruned.append(f"{kind.kind} {name}")
    if applied:
        ctx.emit(body, "Normal", "Applied", ", ".join(applied))
    if corrected:
        ctx.emit(body, "Warning", "DriftCorrected", "changed outside the operator, re-applied: " + "; ".join(corrected))
    if pruned:
        ctx.emit(body, "Normal", "Pruned", ", ".join(pruned))
    return {kind.kind: objs for kind, objs in zip(kinds, listed, strict=True)}


# --- status --------------------------------------------------------------------------------

async def _write_status(ctx: OperatorContext, body: Mapping[str, Any], observation: Observation) -> None:
    meta = body["metadata"]
    old = body.get("status") or {}
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = compute_status(observation, old, now)
    patch = merge_patch(old, new)
    if not patch:
        return
    await ctx.kube.patch(MLLM, meta["namespace"], meta["name"], {"status": patch}, subresource="status")
    ready = transition(old, new, "Ready")
    if ready is not None and ready["reason"] == "InvalidSpec":
        ctx.emit(body, "Warning", "InvalidSpec", ready["message"])
    elif ready is not None and ready["status"] == "True":
        ctx.emit(body, "Normal", "Ready", ready["message"])
