"""The orchestrator's Prometheus metrics: routing decisions, hop times, instance gauges.

`triptych_frontend_routing_decisions_total{stage, policy, outcome}` counts instance
choices (chosen by policy, kept local, placed by cache affinity, retried elsewhere,
`overlapped`: a decode moved make-before-break, its next instance taking over from a
stream that never paused (router/overlap.py), or refused: no instance, overloaded); `triptych_frontend_hop_seconds{stages, outcome}` times
each stage call; `triptych_frontend_instance_{load,ready}{instance, role}` mirror the
registry at scrape time; `triptych_frontend_hop_phase_seconds{phase}` splits a hop (connect,
headers, first event) and `triptych_frontend_worker_connections_opened_total` counts new
connections to workers (a persistent connection is reused, so it should stay flat).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from triptych.router.registry import Registry
from triptych.router.routing import Decision

_HOP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry | None, registry_view: Registry) -> None:
        self.decisions = Counter("triptych_frontend_routing_decisions",
                                 "Instance choices per stage: chosen by policy, kept local, by cache "
                                 "affinity, retried elsewhere, or refused (no instance, overloaded)",
                                 ["stage", "policy", "outcome"], registry=registry)
        self._children: dict[tuple[str, ...], Any] = {}  # labelled children by (metric, *labels): _child
        self.hop_seconds = Histogram("triptych_frontend_hop_seconds",
                                     "Wall time of one stage call (a hop) seen from the router",
                                     ["stages", "outcome"], registry=registry, buckets=_HOP_BUCKETS)
        self.hop_phase_seconds = Histogram(
            "triptych_frontend_hop_phase_seconds",
            "Parts of a hop seen from the router: connect (a new connection to the worker; reused "
            "ones skip it), headers (POST to response headers), first_event (POST to the first event)",
            ["phase"], registry=registry,
            buckets=(1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
        self.connections_opened = Counter(
            "triptych_frontend_worker_connections_opened",
            "TCP connections the router opened to workers (persistent ones are reused: this stays "
            "near the number of workers)", registry=registry)
        if registry is not None:
            registry.register(_InstanceGauges(registry_view))

    def decided(self, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            _child(self._children, self.decisions, d.stage.value, d.policy, d.outcome).inc()

    def hop_phase(self, phase: str, seconds: float) -> None:
        _child(self._children, self.hop_phase_seconds, phase).observe(seconds)

    def hop(self, stages: str, outcome: str, seconds: float) -> None:
        _child(self._children, self.hop_seconds, stages, outcome).observe(seconds)


def _child(cache: dict[tuple[str, ...], Any], metric: MetricWrapperBase, *labels: str) -> Any:
    """`metric.labels(*labels)`, looked up once per label set: `labels()` takes a lock and
    builds keys, several times per request on the router's hot path."""
    key = (metric._name, *labels)
    child = cache.get(key)
    if child is None:
        child = cache[key] = metric.labels(*labels)
    return child


class _InstanceGauges(Collector):
    """Each instance's last reported load and whether it is routable, read at scrape time."""

    def __init__(self, view: Registry) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        load = GaugeMetricFamily("triptych_frontend_instance_load",
                                 "Queued work each instance reported at its last health probe",
                                 labels=["instance", "role"])
        ready = GaugeMetricFamily("triptych_frontend_instance_ready", "1 when routable",
                                  labels=["instance", "role"])
        for inst in self.view.instances.values():
            labels = [inst.url, inst.role.value if inst.role else "unassigned"]
            load.add_metric(labels, inst.load)
            ready.add_metric(labels, float(inst.ready and not inst.draining))
        yield load
        yield ready
