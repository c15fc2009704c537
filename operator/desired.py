"""The desired state: an MLLMDeployment (already validated) -> the child objects it should have.

Pure: no I/O and no clock. The objects come from modules by concern: worker_objects.py
(pools, workers Service), router_objects.py, policies.py (budgets, NetworkPolicy,
ServiceMonitor), built from podspec.py and objmeta.py. The same resource always renders
byte-identical objects, each carrying a hash of its own content (`triptych.dev/spec-hash`)
so the reconcile pass (reconcile.py) writes only what changed.

Per deployment `m` in namespace `ns`:
  ConfigMap m-config (serving config), ServiceAccount + RoleBinding m-router (pod watch for
  the router's discovery), one Deployment m-<pool> per worker pool (selector without the
  role, so a pod's role label can change in place), headless Service m-workers, router
  Deployment + Service m-router, PodDisruptionBudgets, a NetworkPolicy for the workers and,
  when the Prometheus Operator CRD exists, a ServiceMonitor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec, pool_assignment, topology_string
from triptych.operator.objmeta import Obj, Owner, common_labels, object_meta, pool_selector, router_selector
from triptych.operator.podspec import model_dir
from triptych.operator.policies import ClusterFacts, network_policy, pdb, service_monitor
from triptych.operator.pool_spec import pool_replicas
from triptych.operator.router_objects import router_deployment, router_rbac, router_service
from triptych.operator.worker_objects import worker_deployment, workers_service
from triptych.topology import InstanceType

__all__ = ["ClusterFacts", "Desired", "Owner", "common_labels", "desired_objects", "model_dir", "pool_assignment",
           "serving_config", "spec_hash"]


@dataclass(frozen=True)
class Desired:
    objects: list[Obj]
    pool_counts: dict[str, dict[InstanceType, int]]  # pool -> instances per type
    # Shared-GPU pools (an EP and a D worker per pod): roles are planned for the pod's EP.
    colocated: frozenset[str] = frozenset()

    def role_counts(self, pool: str) -> dict[InstanceType, int]:
        """What the role planner (roles.plan_pool) gives the pool's pods."""
        counts = self.pool_counts[pool]
        return {InstanceType.EP: counts.get(InstanceType.EP, 0)} if pool in self.colocated else counts

    def by_kind(self, kind: str) -> dict[str, Obj]:
        return {o["metadata"]["name"]: o for o in self.objects if o["kind"] == kind}


def desired_objects(owner: Owner, spec: MLLMDeploymentSpec, facts: ClusterFacts) -> Desired:
    counts = pool_assignment(spec)
    objects: list[Obj] = [_config_map(owner, spec, counts), *router_rbac(owner)]
    for pool in spec.effective_pools():
        replicas = pool_replicas(pool, counts[pool.name])
        objects.append(worker_deployment(owner, spec, pool, replicas))
        objects.append(pdb(owner, names.worker_deployment_name(owner.name, pool.name),
                           pool_selector(owner, pool.name), pool.max_unavailable, names.COMPONENT_WORKER))
    objects += [
        workers_service(owner, spec),
        router_deployment(owner, spec),
        router_service(owner, spec),
        pdb(owner, names.router_name(owner.name), router_selector(owner), 1, names.COMPONENT_ROUTER),
    ]
    if spec.network_policy.enabled:
        objects.append(network_policy(owner, spec, facts))
    if spec.monitoring.service_monitor and facts.service_monitor_crd:
        objects.append(service_monitor(owner, spec))
    colocated = frozenset(p.name for p in spec.effective_pools() if p.colocated)
    return Desired([_finalize(o, owner) for o in objects], counts, colocated)


def spec_hash(obj: Obj) -> str:
    """Hash of an object's content without the hash annotation itself."""
    meta = dict(obj.get("metadata", {}))
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != names.ANNOTATION_SPEC_HASH}
    meta["annotations"] = annotations
    canonical = json.dumps({**obj, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _finalize(obj: Obj, owner: Owner) -> Obj:
    meta = obj["metadata"]
    meta["namespace"] = owner.namespace
    meta["ownerReferences"] = [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": owner.name,
                                "uid": owner.uid, "controller": True}]
    meta.setdefault("annotations", {})[names.ANNOTATION_SPEC_HASH] = spec_hash(obj)
    return obj


# --- config, RBAC ------------------------------------------------------------------------

def serving_config(spec: MLLMDeploymentSpec, counts: dict[str, dict[InstanceType, int]], name: str) -> Obj:
    """The serving config every worker and the router read from TRIPTYCH_CONFIG."""
    m = spec.model
    return {
        "model": {"path": model_dir(m.source), "servedModelName": m.served_model_name or name,
                  "family": m.family, "dtype": m.dtype, "maxModelLen": m.max_model_len},
        "topology": topology_string(spec),
        "pools": {pool: {t.value: n for t, n in c.items()} for pool, c in counts.items()},
        "slo": spec.slo.model_dump(by_alias=True),
        "scheduling": spec.scheduling.model_dump(by_alias=True),
        "transfer": spec.transfer.model_dump(by_alias=True),
    }


def _config_map(owner: Owner, spec: MLLMDeploymentSpec, counts: dict[str, dict[InstanceType, int]]) -> Obj:
    config = serving_config(spec, counts, owner.name)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_meta(owner, names.config_map_name(owner.name), "config"),
            "data": {names.CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)}}
