"""Prometheus text exposition -> samples, deltas between two scrapes, histogram quantiles
as PromQL's histogram_quantile computes them, counter sums, and the migration figures of
the serving benchmark (pure)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from triptych.bench.errors import BenchError

Sample = tuple[str, tuple[tuple[str, str], ...], float]  # name, sorted labels, value


def parse_metrics(text: str) -> list[Sample]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric_deltas(before: Sequence[Sample], after: Sequence[Sample]) -> list[Sample]:
    """after - before per sample; a sample that went down (a restarted process reset its
    counters) counts from zero, as Prometheus' increase() does."""
    prev = {(name, labels): value for name, labels, value in before}
    out = []
    for name, labels, value in after:
        old = prev.get((name, labels), 0.0)
        out.append((name, labels, value - old if value >= old else value))
    return out


def histogram_buckets(samples: Iterable[Sample], name: str, **match: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) of histogram `name`, summed over every series whose
    labels include `match` (across transports and instances)."""
    sums: dict[float, float] = {}
    for sname, labels, value in samples:
        lab = dict(labels)
        if sname != f"{name}_bucket" or any(lab.get(k) != v for k, v in match.items()):
            continue
        le = float(lab["le"])
        sums[le] = sums.get(le, 0.0) + value
    return sorted(sums.items())


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank
    q*count (the first bucket starts at 0); a rank in the +Inf bucket gives the highest
    finite bound. None when the histogram is empty."""
    if not 0 <= q <= 1:
        raise BenchError(f"quantile must be within [0, 1], got {q}")
    if not buckets or not math.isinf(buckets[-1][0]):
        raise BenchError("histogram buckets must end with le=+Inf")
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > prev_count:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def counter_sum(samples: Iterable[Sample], name: str, by: Sequence[str] = ()) -> dict[str, float]:
    """Sum of counter `name` grouped by the labels in `by` ("transport=nixl,region=kv")."""
    out: dict[str, float] = {}
    for sname, labels, value in samples:
        if sname != name:
            continue
        lab = dict(labels)
        key = ",".join(f"{k}={lab.get(k, '')}" for k in by) or "all"
        out[key] = out.get(key, 0.0) + value
    return out


MIGRATION = "triptych_worker_migration_seconds"
TRANSFER_BYTES = "triptych_worker_transfer_bytes_total"
ROUTER_TTFT = "triptych_frontend_time_to_first_token_seconds"
ROUTER_HOPS = "triptych_frontend_hop_seconds_count"
ROUTER_CONNECTIONS = "triptych_frontend_worker_connections_opened_total"


def migration_figures(deltas: Sequence[Sample]) -> dict[str, Any]:
    """p50/p95 and count of EP and PD migrations, bytes moved by transport and region."""
    out: dict[str, Any] = {}
    for kind in ("ep", "pd"):
        buckets = histogram_buckets(deltas, MIGRATION, kind=kind)
        count = buckets[-1][1] if buckets else 0.0
        out[f"{kind}_migrations"] = int(count)
        for q in (50, 95):
            out[f"{kind}_migration_p{q}_s"] = histogram_quantile(q / 100, buckets) if count else None
    transports = {dict(lab).get("transport") for name, lab, v in deltas
                  if name == f"{MIGRATION}_count" and v > 0}
    out["migration_transports"] = sorted(t for t in transports if t)
    out["transfer_bytes"] = {k: int(v) for k, v in
                             counter_sum(deltas, TRANSFER_BYTES, ("transport", "region")).items() if v}
    out["transfer_bytes_total"] = int(sum(out["transfer_bytes"].values()))
    ttft = histogram_buckets(deltas, ROUTER_TTFT)
    out["router_ttft_p50_s"] = histogram_quantile(0.5, ttft) if ttft and ttft[-1][1] else None
    # Persistent router->worker connections: far fewer opened than hops run.
    out["router_hops"] = int(sum(counter_sum(deltas, ROUTER_HOPS).values()))
    out["router_worker_connections_opened"] = int(sum(counter_sum(deltas, ROUTER_CONNECTIONS).values()))
    return out
