"""The planner's view of a running deployment: one typed snapshot, built either from
Prometheus's HTTP API (PromQL over httpx) or, locally without Prometheus, from two scrapes
of the components' `/metrics` text (rates and quantiles from the difference).

Metric names are docs/architecture.md's Metrics table (router/metrics.py,
router/orchestrator.py, worker/server.py):

- queued work per stage: `triptych_worker_requests{instance,role,state="waiting"}` split
  evenly over the stages of the instance's role, and `triptych_frontend_instance_load
  {instance,role}` (queued tokens + images each worker reports): tokens for roles that
  prefill, images for E — the fallback for workers that predate the per-stage queues
  `triptych_worker_queued_requests|tokens|images{instance,role,stage}` (worker/metrics.py),
  which win when present;
- TTFT / TBT p90: the router's histograms; attainment: `triptych_frontend_slo_requests_total
  {result}` (the window gauge when no rate can be taken);
- arrival rate and request shape: finished requests (`..._e2e_request_latency_seconds_count`),
  `..._images_total`, `..._prompt_tokens_total`, `..._generation_tokens_total`;
- instances per type: `triptych_frontend_instance_ready{role}`;
- decode pressure (a bottleneck at D shows no queue: a handed-over request is seated at
  once, so it shows as slower tokens and fuller batches): TPOT p90 (the router's
  histogram), and over the instances whose role decodes, requests running
  (`triptych_worker_requests{state="running"}`) against their seats
  (`triptych_worker_max_num_seqs`) and KV blocks used against used + free
  (`triptych_worker_cache_blocks{cache="kv"}`);
- video decode: GOP sets the router has planned and V instances not yet decoded
  (`triptych_frontend_video_queued_gop_sets`); V instances are `instance_ready{role="V"}`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from triptych.topology import InstanceType, Stage

F = "triptych_frontend"
W = "triptych_worker"
STAGES = tuple(s.value for s in Stage)


class StageQueue(BaseModel):
    requests: float = 0.0
    tokens: float = 0.0
    images: float = 0.0
    instances: int = Field(0, description="ready instances that run this stage")


class DecodeLoad(BaseModel):
    """Over the instances whose role runs decode (D, PD, ED, EPD)."""

    running: float = Field(0.0, description="requests running on them")
    seats: float = Field(0.0, description="their max_num_seqs, summed (0: not exported)")
    kv_used_blocks: float = 0.0
    kv_total_blocks: float = Field(0.0, description="used + free (0: not exported)")

    @property
    def occupancy(self) -> float | None:
        return self.running / self.seats if self.seats > 0 else None

    @property
    def kv_use(self) -> float | None:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks > 0 else None


class Snapshot(BaseModel):
    at: float
    source: Literal["prometheus", "scrape"]
    queues: dict[str, StageQueue] = Field(default_factory=lambda: {s: StageQueue() for s in STAGES})
    instances: dict[str, int] = Field(default_factory=dict, description="ready instances per type")
    ttft_p90_s: float | None = None
    tbt_p90_s: float | None = None
    slo_attainment: float | None = None
    arrival_rate_rps: float | None = None
    images_per_request: float | None = None
    prompt_tokens_per_request: float | None = None
    output_tokens_per_request: float | None = None
    tpot_p90_s: float | None = None
    decode: DecodeLoad = Field(default_factory=DecodeLoad)
    video_queued_gop_sets: float | None = Field(None, description="GOP sets waiting for a V decoder")


# --- shared: per-instance queue rows -> per-stage queues --------------------------------
def _stages_of(role: str) -> list[str]:
    try:
        return [s.value for s in InstanceType(role).stages]
    except ValueError:
        return []  # unassigned


def _queues(waiting: Iterable[tuple[str, float]], load: Iterable[tuple[str, float]],
            ready: Iterable[tuple[str, float]],
            per_stage: dict[str, dict[str, float]] | None) -> tuple[dict[str, StageQueue], dict[str, int]]:
    queues = {s: StageQueue() for s in STAGES}
    instances: dict[str, int] = defaultdict(int)
    for role, up in ready:
        if up >= 1:
            instances[role] += 1
            for s in _stages_of(role):
                queues[s].instances += 1
    for role, n in waiting:
        stages = _stages_of(role)
        for s in stages:
            queues[s].requests += n / len(stages)
    for role, work in load:
        stages = _stages_of(role)
        if Stage.PREFILL.value in stages:
            queues[Stage.PREFILL.value].tokens += work
        elif stages == [Stage.ENCODE.value]:
            queues[Stage.ENCODE.value].images += work
    if per_stage:  # exact per-stage figures from the workers replace the estimates
        for field, by_stage in per_stage.items():
            for s, v in by_stage.items():
                if s in queues:
                    setattr(queues[s], field, v)
    return queues, dict(instances)


def _runs_decode(role: str) -> bool:
    return Stage.DECODE.value in _stages_of(role)


def _decode_load(running: Iterable[tuple[str, float]], seats: Iterable[tuple[str, float]],
                 kv_used: Iterable[tuple[str, float]], kv_free: Iterable[tuple[str, float]]) -> DecodeLoad:
    """(role, value) rows -> sums over the roles that decode."""
    def total(rows: Iterable[tuple[str, float]]) -> float:
        return sum(v for role, v in rows if _runs_decode(role) and not math.isnan(v))
    used = total(kv_used)
    return DecodeLoad(running=total(running), seats=total(seats), kv_used_blocks=used,
                      kv_total_blocks=used + total(kv_free))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


# --- from Prometheus ----------------------------------------------------------------------
Vector = list[tuple[dict[str, str], float]]


class PrometheusClient:
    """Instant queries over Prometheus's HTTP API (`/api/v1/query`)."""

    def __init__(self, url: str, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, transport=transport)

    def query(self, promql: str) -> Vector:
        r = self._http.get("/api/v1/query", params={"query": promql})
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query failed: {body.get('error', body)}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(row.get("metric", {}), float(row["value"][1])) for row in data["result"]]

    def close(self) -> None:
        self._http.close()


def promql(window: str = "2m") -> dict[str, str]:
    """The queries a snapshot needs, by field."""
    w = window
    return {
        "waiting": f'sum by (role) ({W}_requests{{state="waiting"}})',
        "load": f"sum by (role) ({F}_instance_load)",
        "ready": f"{F}_instance_ready",
        "queued_requests": f"sum by (stage) ({W}_queued_requests)",
        "queued_tokens": f"sum by (stage) ({W}_queued_tokens)",
        "queued_images": f"sum by (stage) ({W}_queued_images)",
        "ttft_p90": f"histogram_quantile(0.9, sum by (le) (rate({F}_time_to_first_token_seconds_bucket[{w}])))",
        "tbt_p90": f"histogram_quantile(0.9, sum by (le) (rate({F}_time_between_tokens_seconds_bucket[{w}])))",
        "tpot_p90": f"histogram_quantile(0.9, sum by (le) (rate({F}_time_per_output_token_seconds_bucket[{w}])))",
        "running": f'sum by (role) ({W}_requests{{state="running"}})',
        "seats": f"sum by (role) ({W}_max_num_seqs)",
        "kv_used": f'sum by (role) ({W}_cache_blocks{{cache="kv",state="used"}})',
        "kv_free": f'sum by (role) ({W}_cache_blocks{{cache="kv",state="free"}})',
        "video_gop_sets": f"sum({F}_video_queued_gop_sets)",
        "slo_met": f'sum(rate({F}_slo_requests_total{{result="met"}}[{w}]))',
        "slo_all": f"sum(rate({F}_slo_requests_total[{w}]))",
        "slo_gauge": f"avg({F}_slo_attainment)",
        "finished": f"sum(rate({F}_e2e_request_latency_seconds_count[{w}]))",
        "images": f"sum(rate({F}_images_total[{w}]))",
        "prompt": f"sum(rate({F}_prompt_tokens_total[{w}]))",
        "output": f"sum(rate({F}_generation_tokens_total[{w}]))",
    }


def snapshot_from_prometheus(query: Callable[[str], Vector], window: str = "2m",
                             now: float | None = None) -> Snapshot:
    q = {k: query(v) for k, v in promql(window).items()}

    def one(key: str) -> float | None:
        vals = [v for _, v in q[key] if not math.isnan(v)]
        return vals[0] if vals else None

    def by(key: str, label: str) -> list[tuple[str, float]]:
        return [(m.get(label, ""), v) for m, v in q[key]]

    per_stage = {f: dict(by(f"queued_{f}", "stage")) for f in ("requests", "tokens", "images")}
    per_stage = {f: d for f, d in per_stage.items() if d}
    queues, instances = _queues(by("waiting", "role"), by("load", "role"), by("ready", "role"), per_stage)
    finished = one("finished")
    attainment = _ratio(one("slo_met"), one("slo_all"))
    return Snapshot(
        at=time.time() if now is None else now, source="prometheus", queues=queues, instances=instances,
        ttft_p90_s=one("ttft_p90"), tbt_p90_s=one("tbt_p90"), tpot_p90_s=one("tpot_p90"),
        decode=_decode_load(by("running", "role"), by("seats", "role"), by("kv_used", "role"), by("kv_free", "role")),
        video_queued_gop_sets=one("video_gop_sets"),
        slo_attainment=attainment if attainment is not None else one("slo_gauge"),
        arrival_rate_rps=finished, images_per_request=_ratio(one("images"), finished),
        prompt_tokens_per_request=_ratio(one("prompt"), finished),
        output_tokens_per_request=_ratio(one("output"), finished))


# --- from /metrics text -------------------------------------------------------------------
Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


def parse_metrics(texts: Iterable[str]) -> dict[Sample, float]:
    """Samples of several components' exposition texts (labels kept, components summed
    where a series repeats)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Sample, float] = defaultdict(float)
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] += s.value
    return dict(out)


def _rows(samples: dict[Sample, float], name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    rows = []
    for (n, labels), v in samples.items():
        d = dict(labels)
        if n == name and all(d.get(k) == val for k, val in match.items()):
            rows.append((d, v))
    return rows


def _total(samples: dict[Sample, float], name: str, **match: str) -> float:
    return sum(v for _, v in _rows(samples, name, **match))


def _bucket_quantile(q: float, prev: dict[Sample, float] | None, cur: dict[Sample, float],
                     name: str) -> float | None:
    """histogram_quantile over the increase of `name`_bucket between two scrapes (linear
    within the bucket, as Prometheus does)."""
    counts: dict[float, float] = defaultdict(float)
    for labels, v in _rows(cur, f"{name}_bucket"):
        counts[float(labels["le"])] += v
    if prev:
        for labels, v in _rows(prev, f"{name}_bucket"):
            counts[float(labels["le"])] -= v
    bounds = sorted(counts)
    if not bounds or counts[bounds[-1]] <= 0:
        return None
    rank, lower, below = q * counts[bounds[-1]], 0.0, 0.0
    for le in bounds:
        if counts[le] >= rank:
            if math.isinf(le):
                return lower
            inside = counts[le] - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, counts[le]
    return None


def snapshot_from_scrapes(prev: dict[Sample, float] | None, cur: dict[Sample, float], dt_s: float | None,
                          now: float | None = None) -> Snapshot:
    """Gauges from `cur`; rates and quantiles from `cur - prev` over `dt_s` (none on the
    first scrape, except the attainment gauge)."""
    def by_role(name: str, **match: str) -> list[tuple[str, float]]:
        return [(d.get("role", ""), v) for d, v in _rows(cur, name, **match)]

    per_stage = {}
    for field in ("requests", "tokens", "images"):
        rows = _rows(cur, f"{W}_queued_{field}")
        if rows:  # one row per instance and stage: summed per stage, as `sum by (stage)`
            by_stage: dict[str, float] = defaultdict(float)
            for d, v in rows:
                by_stage[d.get("stage", "")] += v
            per_stage[field] = dict(by_stage)
    queues, instances = _queues(by_role(f"{W}_requests", state="waiting"), by_role(f"{F}_instance_load"),
                                by_role(f"{F}_instance_ready"), per_stage)
    snap = Snapshot(at=time.time() if now is None else now, source="scrape", queues=queues, instances=instances)
    snap.decode = _decode_load(by_role(f"{W}_requests", state="running"), by_role(f"{W}_max_num_seqs"),
                               by_role(f"{W}_cache_blocks", cache="kv", state="used"),
                               by_role(f"{W}_cache_blocks", cache="kv", state="free"))
    video = _rows(cur, f"{F}_video_queued_gop_sets")
    snap.video_queued_gop_sets = sum(v for _, v in video) if video else None
    gauge = _rows(cur, f"{F}_slo_attainment")
    snap.slo_attainment = sum(v for _, v in gauge) / len(gauge) if gauge else None
    if prev is None or not dt_s or dt_s <= 0:
        return snap

    def rate(name: str, **match: str) -> float:
        return max(0.0, _total(cur, name, **match) - _total(prev, name, **match)) / dt_s

    finished = rate(f"{F}_e2e_request_latency_seconds_count")
    met, missed = rate(f"{F}_slo_requests_total", result="met"), rate(f"{F}_slo_requests_total", result="missed")
    if met + missed > 0:
        snap.slo_attainment = met / (met + missed)
    snap.ttft_p90_s = _bucket_quantile(0.9, prev, cur, f"{F}_time_to_first_token_seconds")
    snap.tbt_p90_s = _bucket_quantile(0.9, prev, cur, f"{F}_time_between_tokens_seconds")
    snap.tpot_p90_s = _bucket_quantile(0.9, prev, cur, f"{F}_time_per_output_token_seconds")
    snap.arrival_rate_rps = finished
    snap.images_per_request = _ratio(rate(f"{F}_images_total"), finished)
    snap.prompt_tokens_per_request = _ratio(rate(f"{F}_prompt_tokens_total"), finished)
    snap.output_tokens_per_request = _ratio(rate(f"{F}_generation_tokens_total"), finished)
    return snap


class Scraper:
    """Local mode: GET each component's /metrics; each `snapshot()` compares with the last."""

    def __init__(self, urls: list[str], timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None) -> None:
        self.urls = urls
        self._http = httpx.Client(timeout=timeout_s, transport=transport)
        self._prev: tuple[float, dict[Sample, float]] | None = None

    def snapshot(self) -> Snapshot:
        texts = []
        for url in self.urls:
            r = self._http.get(url.rstrip("/") + "/metrics")
            r.raise_for_status()
            texts.append(r.text)
        now, cur = time.time(), parse_metrics(texts)
        prev = self._prev
        self._prev = (now, cur)
        return snapshot_from_scrapes(prev[1] if prev else None, cur, now - prev[0] if prev else None, now)

    def close(self) -> None:
        self._http.close()
