"""Policies around the pods: disruption budgets, the workers' NetworkPolicy, the ServiceMonitor. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec
from triptych.operator.objmeta import Obj, Owner, object_meta, router_selector, workers_selector


@dataclass(frozen=True)
class ClusterFacts:
    """What the cluster offers, discovered by the caller (the only non-spec inputs)."""

    service_monitor_crd: bool = False
    operator_namespace: str | None = None  # None: allow the operator's pods from any namespace
    operator_labels: dict[str, str] = field(default_factory=lambda: {names.LABEL_NAME: names.OPERATOR_NAME})


def pdb(owner: Owner, name: str, selector: dict[str, str], max_unavailable: int, component: str) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(owner, name, component),
            "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": selector}}}


def network_policy(owner: Owner, spec: MLLMDeploymentSpec, facts: ClusterFacts) -> Obj:
    namespace_selector = ({"matchLabels": {"kubernetes.io/metadata.name": facts.operator_namespace}}
                          if facts.operator_namespace else {})
    http = [{"port": names.PORT_NAME, "protocol": "TCP"}]
    ingress: list[Obj] = [
        # Workers reach each other on any port: NIXL/UCX listens on ephemeral ports.
        {"from": [{"podSelector": {"matchLabels": workers_selector(owner)}}]},
        {"from": [{"podSelector": {"matchLabels": router_selector(owner)}},
                  {"namespaceSelector": namespace_selector,
                   "podSelector": {"matchLabels": dict(facts.operator_labels)}}],
         "ports": http},
    ]
    if spec.network_policy.additional_ingress:
        ingress.append({"from": list(spec.network_policy.additional_ingress), "ports": http})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_meta(owner, names.workers_service_name(owner.name), names.COMPONENT_WORKER),
            "spec": {"podSelector": {"matchLabels": workers_selector(owner)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def service_monitor(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": object_meta(owner, owner.name, "monitoring"),
            "spec": {"selector": {"matchLabels": {names.LABEL_INSTANCE: owner.name,
                                                  names.LABEL_MANAGED_BY: names.OPERATOR_NAME}},
                     "namespaceSelector": {"matchNames": [owner.namespace]},
                     "endpoints": [{"port": names.PORT_NAME, "path": "/metrics",
                                    "interval": spec.monitoring.interval}]}}
