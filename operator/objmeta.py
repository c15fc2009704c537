"""Object metadata every child shares: the owner, its labels and the label selectors.

Pure helpers for the desired-state modules (desired.py and the per-concern modules it calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from triptych.kube import names

Obj = dict[str, Any]


@dataclass(frozen=True)
class Owner:
    """The MLLMDeployment being reconciled (what owner references need)."""

    name: str
    namespace: str
    uid: str


def common_labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        names.LABEL_NAME: "triptych",
        names.LABEL_INSTANCE: owner.name,
        names.LABEL_COMPONENT: component,
        names.LABEL_PART_OF: "triptych",
        names.LABEL_MANAGED_BY: names.OPERATOR_NAME,
        names.LABEL_DEPLOYMENT: owner.name,
    }


def pool_selector(owner: Owner, pool: str) -> dict[str, str]:
    # Deliberately without the role: a pod keeps its Deployment when its role changes.
    return {names.LABEL_INSTANCE: owner.name, names.LABEL_COMPONENT: names.COMPONENT_WORKER, names.LABEL_POOL: pool}


def workers_selector(owner: Owner) -> dict[str, str]:
    return {names.LABEL_INSTANCE: owner.name, names.LABEL_COMPONENT: names.COMPONENT_WORKER}


def router_selector(owner: Owner) -> dict[str, str]:
    return {names.LABEL_INSTANCE: owner.name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}


def object_meta(owner: Owner, name: str, component: str, **extra_labels: str) -> Obj:
    return {"name": name, "labels": {**common_labels(owner, component), **extra_labels}}
