"""kopf peering: several operator replicas, one of them active (`triptych operator --peering NAME`).

kopf keeps a keep-alive per operator in the status of a peering object (ClusterKopfPeering
NAME when the operator watches every namespace, KopfPeering NAME in each watched namespace
with --namespace); an operator pauses while a live peer has a higher priority, and resumes
when that peer leaves (it removes its record on exit) or its record expires. With peering
named, kopf starts paused and only resumes once it has seen it is the highest.

The default priority makes the OLDEST replica the active one: a replica started later (a
rollout, a rescheduled pod) joins paused and stays so while the active one lives, so the
active operator changes only when it goes away - never two at once by design. (Same
priorities would pause both: kopf's rule for possible conflicts.)

The CRDs are crds/kopf-peering.yaml; the peering object is created here at start when it
is missing (RBAC: get + create, besides kopf's list/watch/patch).
"""

from __future__ import annotations

import time

from triptych.kube.client import Kind, KubeClient

CLUSTER_PEERING = Kind("kopf.dev/v1", "ClusterKopfPeering", "clusterkopfpeerings", namespaced=False)
NAMESPACED_PEERING = Kind("kopf.dev/v1", "KopfPeering", "kopfpeerings")


def start_priority(now: float | None = None) -> int:
    """Earlier start, higher priority (milliseconds; negative so that older is larger)."""
    return -int((time.time() if now is None else now) * 1000)


async def ensure_peering(kube: KubeClient, name: str, namespaces: list[str]) -> None:
    """Create the peering object(s) kopf will use, unless they exist (a racing replica's 409 is fine)."""
    targets = [(NAMESPACED_PEERING, ns) for ns in namespaces] or [(CLUSTER_PEERING, None)]
    for kind, namespace in targets:
        if await kube.get(kind, namespace or "", name) is None:
            meta = {"name": name} | ({"namespace": namespace} if namespace else {})
            await kube.create(kind, {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": meta})
