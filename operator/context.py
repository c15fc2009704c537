"""Per-process operator state: configuration, API clients, per-deployment locks, cached facts.

One context per operator run (main.py, or each test run). Locks and clients are created
lazily inside the operator's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from triptych.kube.client import SERVICE_MONITOR, Credentials, KubeClient
from triptych.operator.desired import ClusterFacts
from triptych.operator.workers import WorkerAdmin

GONE_MEMORY = 10_000  # deleted resources remembered (uids are never reused)
EventFn = Callable[[Mapping[str, Any], str, str, str], None]


def kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(dict(body), type=type_, reason=reason, message=message)


@dataclass
class OperatorConfig:
    timer_interval: float = 30.0  # periodic full reconcile (missed events, drift of pod state)
    retry_delay: float = 10.0  # after a failed API call in a create/update/resume handler
    role_switch_timeout: float = 300.0
    facts_ttl: float = 60.0  # how long a discovery answer (ServiceMonitor CRD present?) is reused
    operator_namespace: str | None = None  # for the workers' NetworkPolicy; None: any namespace


@dataclass
class OperatorContext:
    connect: Callable[[], Credentials]
    config: OperatorConfig = field(default_factory=OperatorConfig)
    emit: EventFn = kopf_event
    _kube: KubeClient | None = None
    _workers: WorkerAdmin | None = None
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _queued: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    _facts: tuple[float, ClusterFacts] | None = None
    _gone: dict[str, None] = field(default_factory=dict)  # uids of deleted resources (an ordered set)

    @property
    def kube(self) -> KubeClient:
        if self._kube is None:
            self._kube = KubeClient(self.connect)
        return self._kube

    @property
    def workers(self) -> WorkerAdmin:
        if self._workers is None:
            self._workers = WorkerAdmin(timeout=self.config.role_switch_timeout)
        return self._workers

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """Serializes the passes over one deployment (handlers, timer and pod events race)."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def queued_passes(self, namespace: str, name: str) -> set[str]:
        """Kinds of passes ("full", "roles") waiting for the lock of one deployment."""
        return self._queued.setdefault((namespace, name), set())

    def forget(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        """The resource is gone: drop its lock and, given its uid, stop its timer (is_gone)."""
        self._locks.pop((namespace, name), None)
        self._queued.pop((namespace, name), None)
        if uid is not None:
            if len(self._gone) >= GONE_MEMORY:
                self._gone.pop(next(iter(self._gone)))
            self._gone[uid] = None

    def is_gone(self, uid: str) -> bool:
        return uid in self._gone

    async def facts(self) -> ClusterFacts:
        now = time.monotonic()
        if self._facts is None or now - self._facts[0] > self.config.facts_ttl:
            has_monitor = await self.kube.served(SERVICE_MONITOR)
            self._facts = (now, ClusterFacts(service_monitor_crd=has_monitor,
                                             operator_namespace=self.config.operator_namespace))
        return self._facts[1]

    async def aclose(self) -> None:
        if self._kube is not None:
            await self._kube.aclose()
        if self._workers is not None:
            await self._workers.aclose()
