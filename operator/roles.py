"""Role planning for one worker pool: which pod gets which instance type, which pods go.

Pure: pods in, a plan out. Workers start `--role unassigned`; the pool's Deployment only
knows a replica count. The plan keeps as many pods as possible in the role they have
(a switch costs a reload, EPDServe §3.2.4), gives ready unassigned pods the missing roles,
switches surplus pods to missing roles only when no unassigned pod can take them, and, when
the pool has more pods than replicas, picks the pods to remove; those are marked with a low
`controller.kubernetes.io/pod-deletion-cost` *before* the replica count drops, so the
ReplicaSet controller deletes them and not a pod whose role is still wanted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from triptych.kube import names
from triptych.topology import InstanceType

# Canonical order for deterministic plans (the order `format_topology` prints).
TYPE_ORDER: tuple[InstanceType, ...] = tuple(InstanceType(t) for t in ("V", "E", "EP", "ED", "EPD", "P", "PD", "D"))


@dataclass(frozen=True)
class WorkerPod:
    name: str
    role: InstanceType | None  # from the triptych.dev/role label; None = unassigned
    ready: bool  # the pod's Ready condition
    ip: str | None = None
    created: str = ""  # creationTimestamp (RFC 3339 sorts as text)
    terminating: bool = False
    marked: bool = False  # carries our removal deletion cost
    up: bool = False  # its worker's /health answered "ok" or "unassigned" in this pass

    @property
    def assignable(self) -> bool:
        # An unassigned worker is not Ready (its /ready is false until it serves a role), so
        # a pod whose worker answers /health as up can take a role too.
        return (self.ready or self.up) and bool(self.ip) and not self.terminating


@dataclass(frozen=True)
class RoleChange:
    pod: str
    old: InstanceType | None
    new: InstanceType


@dataclass(frozen=True)
class PoolPlan:
    changes: tuple[RoleChange, ...] = ()
    remove: tuple[str, ...] = ()  # mark with the removal deletion cost
    unmark: tuple[str, ...] = ()  # marked earlier, wanted again: drop the mark
    waiting: int = 0  # missing instances no pod can take yet (pods starting or to be created)
    excess: int = 0  # live pods beyond the replica count (waiting for the ReplicaSet to delete them)

    @property
    def settled(self) -> bool:
        return not (self.changes or self.remove or self.unmark or self.waiting or self.excess)


def _removal_order(pods: list[WorkerPod]) -> list[WorkerPod]:
    # Remove not-ready pods first, then unassigned ones (nothing warm to lose), then the newest.
    newest_first = sorted(pods, key=lambda p: (p.created, p.name), reverse=True)
    return sorted(newest_first, key=lambda p: (p.ready, p.role is not None))  # stable


def _keep_rank(pod: WorkerPod) -> tuple[bool, str, str]:
    # Among pods of one role, keep the ready ones, then the oldest.
    return (not pod.ready, pod.created, pod.name)


def plan_pool(desired: Mapping[InstanceType, int], pods: Sequence[WorkerPod]) -> PoolPlan:
    want = {t: n for t, n in desired.items() if n > 0}
    replicas = sum(want.values())
    live = [p for p in pods if not p.terminating]

    kept: dict[InstanceType, list[WorkerPod]] = {}
    free: list[WorkerPod] = []  # unassigned pods and pods whose role is over its count
    for pod in live:
        if pod.role is None:
            free.append(pod)
        else:
            kept.setdefault(pod.role, []).append(pod)
    for role in list(kept):
        ranked = sorted(kept[role], key=_keep_rank)
        kept[role], surplus = ranked[: want.get(role, 0)], ranked[want.get(role, 0):]
        free += surplus

    excess = max(0, len(live) - replicas)
    free = _removal_order(free)
    remove, reuse = free[:excess], free[excess:]

    short = [t for t in TYPE_ORDER for _ in range(want.get(t, 0) - len(kept.get(t, [])))]
    # Unassigned pods first (no warm state to lose), then surplus pods, oldest first.
    candidates = sorted((p for p in reuse if p.assignable), key=lambda p: (p.role is not None, p.created, p.name))
    changes = tuple(RoleChange(p.name, p.role, t) for p, t in zip(candidates, short, strict=False))

    removed = {p.name for p in remove}
    return PoolPlan(
        changes=changes,
        remove=tuple(sorted(p.name for p in remove if not p.marked)),
        unmark=tuple(sorted(p.name for p in live if p.marked and p.name not in removed)),
        waiting=max(0, len(short) - len(changes)),
        excess=excess,
    )


def llmd_role(role: InstanceType | None) -> str | None:
    return names.LLMD_ROLES.get(role) if role is not None else None


def role_labels(role: InstanceType | None) -> dict[str, str | None]:
    """The labels a pod carries for `role`, None = unassigned (None removes a label in a merge patch)."""
    return {names.LABEL_ROLE: role.value if role else None, names.LABEL_LLMD_ROLE: llmd_role(role)}
