"""The worker's Prometheus metrics that are not the transfer layer's: per-stage latency
(HydraInfer §5.5 breakdown) and the instance's state read at scrape time. Migration times
are `migration.service.MIGRATION_SECONDS`; transfers are `transfer.base.TRANSFER_*`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from triptych.topology import Stage
from triptych.worker.transfer.base import registry_metric

if TYPE_CHECKING:
    from triptych.worker.instance import InstanceRuntime

STAGE_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_stage_seconds",
    "Per-request stage latency on this instance (HydraInfer §5.5 breakdown)", ["role", "stage", "phase"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


# The planner's per-stage queue signals (operator/planner/signals.py), one series per stage
# the instance's role runs.
QUEUED_HELP = {
    "requests": "Requests queued on this instance, by the next stage they need here",
    "tokens": "Prompt tokens still to prefill on this instance (prefill only)",
    "images": "Images still to encode on this instance (encode only)",
}


class InstanceCollector(Collector):
    """Queue depths, cache occupancy and outstanding leases, read at scrape time."""

    def __init__(self, instance: InstanceRuntime) -> None:
        self.instance = instance

    def collect(self):  # type: ignore[no-untyped-def]
        inst = self.instance
        labels = ["instance", "role"]
        values = [inst.settings.instance_id, inst.role]
        queue = GaugeMetricFamily("triptych_worker_requests", "Requests on this instance by state",
                                  labels=[*labels, "state"])
        blocks = GaugeMetricFamily("triptych_worker_cache_blocks", "Cache blocks by cache and state",
                                   labels=[*labels, "cache", "state"])
        leases = GaugeMetricFamily("triptych_worker_leases_outstanding", "Hand-overs not yet pulled",
                                   labels=labels)
        leases.add_metric(values, inst.leases_outstanding())
        # The planner's decode pressure (operator/planner/signals.py): running requests
        # against the seats a decode batch has.
        seats = GaugeMetricFamily("triptych_worker_max_num_seqs", "Requests this instance runs at most at once "
                                  "(its batch's seats)", labels=labels)
        # Automatic prefix caching, in prompt tokens (vLLM's prefix_cache_queries/hits).
        hits = CounterMetricFamily("triptych_worker_prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache (not computed)", labels=labels)
        queries = CounterMetricFamily("triptych_worker_prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache", labels=labels)
        per_stage = {field: GaugeMetricFamily(f"triptych_worker_queued_{field}", help_text, labels=[*labels, "stage"])
                     for field, help_text in QUEUED_HELP.items()}
        if inst.engine is not None:
            queued = inst.engine.queued_work()
            for stage in sorted(inst.engine.role.stages, key=list(Stage).index):
                for field, family in per_stage.items():
                    family.add_metric([*values, stage.value], getattr(queued[stage], field))
            stats = inst.engine.stats()
            hits.add_metric(values, stats["counters"]["prefix_cache_hits"])
            queries.add_metric(values, stats["counters"]["prefix_cache_queries"])
            seats.add_metric(values, stats["max_num_seqs"])
            for state in ("waiting", "running", "parked"):
                queue.add_metric([*values, state], stats[f"num_{state}"])
            for cache in ("kv_cache", "mm_cache"):
                for state in ("used", "free", "referenced", "cached"):
                    if cache in stats and state in stats[cache]:
                        blocks.add_metric([*values, cache.removesuffix("_cache"), state], stats[cache][state])
        yield queue
        yield blocks
        yield leases
        yield seats
        yield hits
        yield queries
        yield from per_stage.values()


def stage_breakdown(stages: set[Stage], t: dict[str, float]) -> dict[tuple[str, str], float]:
    """Per-stage queue and exec seconds of one request on this instance (HydraInfer §5.5's
    latency breakdown; the migrations are timed where the pulls happen)."""
    out: dict[tuple[str, str], float] = {}
    arrival = t.get("arrival", 0.0)
    if "encode_start" in t:
        out["encode", "queue"] = t["encode_start"] - arrival
        if "encode_end" in t:
            out["encode", "exec"] = t["encode_end"] - t["encode_start"]
    if "prefill_start" in t:
        out["prefill", "queue"] = t["prefill_start"] - max(arrival, t.get("encode_end", arrival))
        if "prefill_end" in t:
            out["prefill", "exec"] = t["prefill_end"] - t["prefill_start"]
    if Stage.DECODE in stages and "finished" in t:
        if Stage.PREFILL not in stages and "first_scheduled" in t:
            out["decode", "queue"] = t["first_scheduled"] - arrival
        begin = t.get("prefill_end", t.get("first_scheduled"))
        if begin is not None:
            out["decode", "exec"] = t["finished"] - begin
    return {k: max(0.0, v) for k, v in out.items()}


def observe_stages(role: str, stages: set[Stage], timings: dict[str, float]) -> None:
    for (stage, phase), seconds in stage_breakdown(stages, timings).items():
        STAGE_SECONDS.labels(role=role, stage=stage, phase=phase).observe(seconds)
