"""Security rules for an MLLMDeployment's opaque fields, checked before anything is rendered.

The CRD passes volumes, peers and the like through unchanged (`x-kubernetes-preserve-unknown-
fields`), so these rules are what keeps a CR author inside the namespace's bounds:

- Volume sources: only the types the Pod Security Standards' *restricted* profile allows
  (configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected,
  secret). Everything else either reaches the node (hostPath) or makes the kubelet mount
  a remote filesystem chosen by the CR (nfs, iscsi, rbd, ...); use a PersistentVolume (and
  a PVC) for those, which a cluster admin controls.
- emptyDir volumes need a `sizeLimit` (an unbounded one can fill the node's disk or, with
  `medium: Memory`, its memory).
- NetworkPolicy peers may not carry an empty `namespaceSelector` (it selects every
  namespace).
- A router exposed outside the cluster (NodePort, LoadBalancer) needs `apiKeysSecretRef`
  unless `router.allowUnauthenticated` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triptych.operator.api import MLLMDeploymentSpec

ALLOWED_VOLUME_TYPES: frozenset[str] = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"})
EXPOSED_SERVICE_TYPES = ("NodePort", "LoadBalancer")


def volume_problems(where: str, source: Mapping[str, Any]) -> list[str]:
    """Problems with one volume source (the volume's fields without `name`)."""
    kinds = [k for k in source if k != "name"]
    problems = [f"{where}: volume type {k!r} is not allowed (allowed: {', '.join(sorted(ALLOWED_VOLUME_TYPES))})"
                for k in kinds if k not in ALLOWED_VOLUME_TYPES]
    empty_dir = source.get("emptyDir")
    if "emptyDir" in source and not (isinstance(empty_dir, Mapping) and empty_dir.get("sizeLimit")):
        problems.append(f"{where}: emptyDir needs a sizeLimit")
    return problems


def peer_problems(where: str, peers: list[dict[str, Any]]) -> list[str]:
    return [f"{where}[{i}]: an empty namespaceSelector selects every namespace; name the namespaces"
            for i, peer in enumerate(peers) if peer.get("namespaceSelector") == {}]


def safety_problems(spec: MLLMDeploymentSpec) -> list[str]:
    problems: list[str] = []
    if spec.model.source.volume is not None:
        problems += volume_problems("spec.model.source.volume", spec.model.source.volume)
    for pool in spec.effective_pools():
        for volume in pool.volumes:
            problems += volume_problems(f"spec.pools[{pool.name}].volumes[{volume.name}]", volume.model_extra or {})
    problems += peer_problems("spec.networkPolicy.additionalIngress", spec.network_policy.additional_ingress)
    problems += peer_problems("spec.networkPolicy.additionalEgress", spec.network_policy.additional_egress)
    problems += peer_problems("spec.monitoring.scrapers", spec.monitoring.scrapers)
    router = spec.router
    if (router.service_type in EXPOSED_SERVICE_TYPES and router.api_keys_secret_ref is None
            and not router.allow_unauthenticated):
        problems.append(f"spec.router: a {router.service_type} Service is reachable from outside the cluster: "
                        "set apiKeysSecretRef (or allowUnauthenticated: true to serve without API keys)")
    return problems
