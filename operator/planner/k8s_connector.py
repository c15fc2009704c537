"""The Kubernetes connector: a planner decision becomes worker admin calls, pod relabels,
Deployment replicas, an Event on the MLLMDeployment, `spec.topology` and `status.plan`.

While `spec.autoscaling.enabled`, the planner owns spec.topology's counts, as an HPA owns
a Deployment's replicas: every reconcile pass drives the pods to spec.topology, so an
action that did not move spec.topology too would be undone by the next pass. An action is
carried out under the operator's per-deployment lock (the one reconcile passes take):

1. the new counts -> pool counts (api.pool_assignment) -> per changed pool, the same
   roles.plan_pool a reconcile pass would run, so the pod that moves is the one the
   operator itself would pick (a surplus pod, the newest; unassigned pods first);
2. pods leaving are marked with the removal pod-deletion-cost before replicas drop;
3. each role change: `POST /admin/role` on the worker with the deployment's admin token
   (the worker answers once it serves the new role: offload -> migrate -> onload,
   EPDServe §3.2.4), then the pod's role labels;
4. the pool Deployment's replicas (encoder scaling);
5. spec.topology, so the reconcile pass that follows finds nothing to do.

A failed admin call stops the action before spec.topology changes (the next reconcile
pass restores whatever was half done) and is reported as a Warning Event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from triptych.kube import names
from triptych.kube.client import DEPLOYMENT, MLLM, POD, SECRET, KubeClient
from triptych.operator.api import MLLMDeploymentSpec, parse_spec, pool_assignment
from triptych.operator.planner.driver import PlanDocument
from triptych.operator.planner.policy_types import Decision
from triptych.operator.reconcile import worker_pod
from triptych.operator.roles import RoleChange, plan_pool, role_labels
from triptych.operator.tokens import secret_value
from triptych.topology import InstanceType

Obj = dict[str, Any]
EventFn = Callable[[Mapping[str, Any], str, str, str], None]
TokenSource = Callable[[KubeClient, str, str], Awaitable[str | None]]



async def read_admin_token(kube: KubeClient, namespace: str, deployment: str) -> str | None:
    """The admin token from the deployment's Secret; None when there is none (workers that
    do not check a token yet)."""
    secret = await kube.get(SECRET, namespace, names.tokens_secret_name(deployment))
    return secret_value(secret, names.SECRET_KEY_ADMIN_TOKEN) if secret else None


class ActionError(RuntimeError):
    """The connector could not carry out a decision."""


def pod_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == names.PORT_NAME:
                return int(port["containerPort"])
    return names.WORKER_PORT


def counts_after(counts: Mapping[InstanceType, int], decision: Decision) -> dict[InstanceType, int]:
    """The counts the decision asks for, applied to the counts as they are now (the spec
    may have changed since the decision was taken)."""
    out = dict(counts)
    if decision.action == "switch_role":
        assert decision.from_type is not None and decision.to_type is not None
        if out.get(decision.from_type, 0) < 1:
            raise ActionError(f"no {decision.from_type.value} instance left to switch")
        out[decision.from_type] -= 1
        out[decision.to_type] = out.get(decision.to_type, 0) + 1
    elif decision.action == "scale":
        assert decision.scale_type is not None
        out[decision.scale_type] = max(0, out.get(decision.scale_type, 0) + decision.delta)
    return out


class KubeConnector:
    """Acts for one operator: shares its API client, locks and Event function."""

    def __init__(self, kube: KubeClient, lock: Callable[[str, str], Any], emit: EventFn,
                 token_source: TokenSource = read_admin_token, timeout_s: float = 300.0) -> None:
        self.kube = kube
        self.lock = lock
        self.emit = emit
        self.token_source = token_source
        self.timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None

    async def act(self, namespace: str, name: str, decision: Decision) -> str | None:
        """Carry out `decision` (not a dry run, not `none`); returns an error message or None."""
        if decision.action == "none" or decision.dry_run:
            return None
        async with self.lock(namespace, name):
            body = await self.kube.get(MLLM, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return "the MLLMDeployment is gone"
            try:
                done = await self._act_locked(body, decision)
            except (ActionError, httpx.HTTPError) as e:
                message = f"{_describe(decision)} failed: {e}"
                self.emit(body, "Warning", "PlannerActionFailed", message)
                return message
            self.emit(body, "Normal", _event_reason(decision), f"{_describe(decision)}{done}: {decision.reason}")
            return None

    async def _act_locked(self, body: Mapping[str, Any], decision: Decision) -> str:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        spec = parse_spec(body.get("spec"), name=name)
        new_counts = counts_after(spec.counts(), decision)
        new_spec = spec.model_copy(update={"topology": new_counts})
        before, after = pool_assignment(spec), pool_assignment(new_spec)
        raw = {p["metadata"]["name"]: p for p in await self.kube.list(POD, namespace, names.worker_selector(name))}
        moved: list[str] = []
        for pool in after:
            if after[pool] == before.get(pool, {}):
                continue
            pods = [worker_pod(p) for p in raw.values()
                    if (p["metadata"].get("labels") or {}).get(names.LABEL_POOL) == pool]
            plan = plan_pool(after[pool], pods)
            for pod in plan.remove:  # before replicas drop: the ReplicaSet deletes these first
                await self.kube.patch(POD, namespace, pod, {"metadata": {"annotations": {
                    names.ANNOTATION_DELETION_COST: names.REMOVAL_DELETION_COST}}})
            for change in plan.changes:
                await self._switch(namespace, name, change, raw[change.pod])
                moved.append(f"{change.pod} {change.old.value if change.old else 'unassigned'} -> "
                              f"{change.new.value}")
            replicas = sum(after[pool].values())
            if replicas != sum(before.get(pool, {}).values()):
                await self.kube.patch(DEPLOYMENT, namespace, names.worker_deployment_name(name, pool),
                                      {"spec": {"replicas": replicas}})
                moved.append(f"{names.worker_deployment_name(name, pool)} replicas {replicas}")
        await self.kube.patch(MLLM, namespace, name, {"spec": {"topology": _topology_patch(spec, new_spec)}})
        return f" ({'; '.join(moved)})" if moved else ""

    async def _switch(self, namespace: str, name: str, change: RoleChange, pod: Mapping[str, Any]) -> None:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            raise ActionError(f"{change.pod} has no IP")
        token = await self.token_source(self.kube, namespace, name)
        url = f"http://{ip}:{pod_port(pod)}/admin/role"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if self._http is None:  # a switch touching E loads or drops weights before it answers
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0))
        response = await self._http.post(url, json={"role": change.new.value}, headers=headers)
        if response.status_code != 200:
            raise ActionError(f"{change.pod}: {url}: HTTP {response.status_code}: {response.text[:200]}")
        await self.kube.patch(POD, namespace, change.pod, {"metadata": {"labels": role_labels(change.new)}})

    async def record(self, body: Mapping[str, Any], decision: Decision, doc: PlanDocument) -> None:
        """status.plan on every decision; an Event for each action (dry runs included) -
        a non-decision every interval would flood the Events."""
        meta = body["metadata"]
        plan = doc.model_dump(mode="json", exclude={"snapshot"})
        await self.kube.patch(MLLM, meta["namespace"], meta["name"], {"status": {"plan": plan}},
                              subresource="status")
        if decision.action != "none" and decision.dry_run:
            self.emit(body, "Normal", "PlannerDryRun", f"would {_describe(decision)}: {decision.reason}")

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _topology_patch(old: MLLMDeploymentSpec, new: MLLMDeploymentSpec) -> dict[str, int]:
    keys = set(old.topology) | set(new.topology)
    return {k.value: new.topology.get(k, 0) for k in sorted(keys, key=lambda k: k.value)}


def _event_reason(decision: Decision) -> str:
    return "PlannerRoleSwitch" if decision.action == "switch_role" else "PlannerScale"


def _describe(decision: Decision) -> str:
    if decision.action == "switch_role":
        assert decision.from_type is not None and decision.to_type is not None
        return f"switch one {decision.from_type.value} to {decision.to_type.value}"
    if decision.action == "scale":
        assert decision.scale_type is not None
        return f"scale {decision.scale_type.value} by {decision.delta:+d}"
    return "nothing"
