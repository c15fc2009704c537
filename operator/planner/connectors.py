"""Actuation: how a decision reaches a deployment.

One interface, one connector per environment: Kubernetes (k8s_connector.py: worker admin
API + relabel, Deployment replicas, an Event and status.plan per decision) and local
(local_connector.py: the router's `POST /admin/role`, instance processes). The recording
connector here serves tests and dry runs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pydantic import BaseModel

from triptych.operator.planner.policy_types import Decision
from triptych.topology import InstanceType


@runtime_checkable
class Connector(Protocol):
    def switch_role(self, instance: str, role: InstanceType) -> None:
        """Zero-loss role switch of one instance (offload -> migrate -> onload, EPDServe §3.2.4)."""

    def set_replicas(self, kind: InstanceType, n: int) -> None:
        """Run n instances of this type (encoder autoscaling)."""

    def record(self, decision: Decision) -> None:
        """Make the decision visible (Event, status.plan, metrics, /plan), acted on or not."""


class Call(BaseModel):
    method: str
    args: list[str | int]


class RecordingConnector:
    """Remembers every call; instances are named `<type>-<i>` from a starting topology."""

    def __init__(self, counts: dict[InstanceType, int]) -> None:
        self.roles: dict[str, InstanceType] = {f"{k.value.lower()}-{i}": k for k, n in counts.items() for i in range(n)}
        self.calls: list[Call] = []
        self.decisions: list[Decision] = []

    def counts(self) -> dict[InstanceType, int]:
        out: dict[InstanceType, int] = {}
        for kind in self.roles.values():
            out[kind] = out.get(kind, 0) + 1
        return out

    def switch_role(self, instance: str, role: InstanceType) -> None:
        self.calls.append(Call(method="switch_role", args=[instance, role.value]))
        self.roles[instance] = role

    def set_replicas(self, kind: InstanceType, n: int) -> None:
        self.calls.append(Call(method="set_replicas", args=[kind.value, n]))
        have = sorted(name for name, k in self.roles.items() if k == kind)
        for name in have[n:]:
            del self.roles[name]
        for i in range(len(have), n):
            self.roles[f"{kind.value.lower()}-new{i}"] = kind

    def record(self, decision: Decision) -> None:
        self.decisions.append(decision)


def pick_instance(roles: dict[str, InstanceType], kind: InstanceType) -> str:
    """The instance a switch moves: the last of its type by name (the actuation round will
    pick by least in-flight work and pod-deletion-cost)."""
    names = sorted(n for n, k in roles.items() if k == kind)
    if not names:
        raise ValueError(f"no {kind.value} instance to switch")
    return names[-1]


def apply(decision: Decision, connector: Connector, roles: dict[str, InstanceType],
          counts: dict[InstanceType, int]) -> None:
    """Record the decision; act on it unless it is a dry run or a non-decision."""
    if not decision.dry_run:
        if decision.action == "switch_role":
            assert decision.from_type is not None and decision.to_type is not None
            connector.switch_role(pick_instance(roles, decision.from_type), decision.to_type)
        elif decision.action == "scale":
            assert decision.scale_type is not None
            connector.set_replicas(decision.scale_type, counts.get(decision.scale_type, 0) + decision.delta)
    connector.record(decision)
