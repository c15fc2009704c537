"""Policies around the pods: disruption budgets, the workers' NetworkPolicy, the ServiceMonitor. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec
from triptych.operator.objmeta import Obj, Owner, object_meta, router_selector, workers_selector

NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


@dataclass(frozen=True)
class ClusterFacts:
    """What the cluster offers, discovered by the caller (the only non-spec inputs)."""

    service_monitor_crd: bool = False
    operator_namespace: str | None = None  # None (outside a cluster): no ingress rule for the operator
    operator_labels: dict[str, str] = field(default_factory=lambda: {names.LABEL_NAME: names.OPERATOR_NAME})


def pdb(owner: Owner, name: str, selector: dict[str, str], max_unavailable: int, component: str) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(owner, name, component),
            # AlwaysAllow: pods that are not Ready (crash-looping, stuck loading) may always be
            # evicted, so a budget never blocks a node drain forever (maxUnavailable is >= 1 too).
            "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": selector},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def network_policy(owner: Owner, spec: MLLMDeploymentSpec, facts: ClusterFacts) -> Obj:
    """Ingress: workers of this deployment (any port), and on the http port its router, the
    operator (role switches), `additionalIngress` and, with monitoring on, the scrapers.
    Egress: workers of this deployment (any port), DNS, `additionalEgress`; workers never call
    the API server (no service-account token). No peer selects every namespace: the
    operator's pods are allowed only from its own namespace, when that is known."""
    http = [{"port": port, "protocol": "TCP"} for port in worker_port_names(spec)]
    workers = {"podSelector": {"matchLabels": workers_selector(owner)}}
    callers: list[Obj] = [{"podSelector": {"matchLabels": router_selector(owner)}}]
    if facts.operator_namespace:
        callers.append({"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: facts.operator_namespace}},
                        "podSelector": {"matchLabels": dict(facts.operator_labels)}})
    # Workers reach each other on any port: NIXL/UCX listens on ephemeral ports.
    ingress: list[Obj] = [{"from": [workers]}, {"from": callers, "ports": http}]
    if spec.network_policy.additional_ingress:
        ingress.append({"from": list(spec.network_policy.additional_ingress), "ports": http})
    if spec.monitoring.service_monitor and spec.monitoring.scrapers:  # /metrics is on the http port
        ingress.append({"from": list(spec.monitoring.scrapers), "ports": http})
    # DNS to any address on port 53: where cluster DNS runs (and how it is labelled) varies.
    dns = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    egress: list[Obj] = [{"to": [workers]}, dns]
    if spec.network_policy.additional_egress:
        egress.append({"to": list(spec.network_policy.additional_egress)})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_meta(owner, names.workers_service_name(owner.name), names.COMPONENT_WORKER),
            "spec": {"podSelector": {"matchLabels": workers_selector(owner)},
                     "policyTypes": ["Ingress", "Egress"], "ingress": ingress, "egress": egress}}


def service_monitor(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": object_meta(owner, owner.name, "monitoring"),
            "spec": {"selector": {"matchLabels": {names.LABEL_INSTANCE: owner.name,
                                                  names.LABEL_MANAGED_BY: names.OPERATOR_NAME}},
                     "namespaceSelector": {"matchNames": [owner.namespace]},
                     "endpoints": [{"port": port, "path": "/metrics", "interval": spec.monitoring.interval}
                                   for port in worker_port_names(spec)]}}


def worker_port_names(spec: MLLMDeploymentSpec) -> list[str]:
    """The workers' HTTP port names: `http`, and `http-decode` when a shared-GPU pool runs a
    second (D) worker per pod (shared_gpu.py)."""
    colocated = any(p.colocated for p in spec.effective_pools())
    return [names.PORT_NAME, names.DECODE_PORT_NAME] if colocated else [names.PORT_NAME]
