"""The router's Prometheus metrics (`triptych_frontend_*`, seconds, label `model`).

Latencies are measured where the client sees them: from the moment the router has the
request to the moment a token event reaches the response stream. Tokens that arrive in
one event reach the client together, so the extra tokens of an event count as 0 s gaps.

SLO (HydraInfer §2.3): a request meets its SLO when TTFT <= the TTFT SLO and at least
90% of its token gaps are <= the TBT SLO. Attainment is exported two ways: counters
(`slo_requests_total{result="met"|"missed"}`, rate them in PromQL) and a gauge over the
last `slo_window` finished requests (for dashboards and the planner's quick look).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "triptych_frontend"
TBT_QUANTILE = 0.9  # share of token gaps that must meet the TBT SLO

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_TBT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


def meets_slo(ttft_s: float, gaps_s: list[float], ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """HydraInfer §2.3. A request with no gaps (one token) is judged on TTFT alone."""
    if ttft_s > ttft_slo_s:
        return False
    if not gaps_s:
        return True
    within = sum(1 for g in gaps_s if g <= tbt_slo_s)
    return within >= TBT_QUANTILE * len(gaps_s)


class FrontendMetrics:
    def __init__(self, model: str, ttft_slo_s: float, tbt_slo_s: float, window: int = 1000,
                 registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model"]
        self.requests = Counter(f"{PREFIX}_requests", "Finished API requests by HTTP status "
                                "(499: client went away; a mid-stream failure counts with its error status)",
                                ["model", "status"], registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "API requests being served now", m, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token", m,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tbt = Histogram(f"{PREFIX}_time_between_tokens_seconds", "Gap between consecutive output tokens",
                             m, buckets=_TBT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Per request: (E2E - TTFT) / (output tokens - 1)", m, buckets=_TBT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to last token", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.preprocess = Histogram(f"{PREFIX}_preprocess_seconds",
                                    "Image loading, chat template and tokenization", m,
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", m, registry=r)
        self.images = Counter(f"{PREFIX}_images", "Images in admitted requests", m, registry=r)
        self.slo_requests = Counter(f"{PREFIX}_slo_requests", "Finished requests by SLO outcome (HydraInfer §2.3)",
                                    ["model", "result"], registry=r)
        self.slo_attainment = Gauge(f"{PREFIX}_slo_attainment",
                                    "Share of the last N finished requests that met the SLO", m, registry=r)
        self._window: deque[bool] = deque(maxlen=window)
        for result in ("met", "missed"):  # export zeros so rate() works from the start
            self.slo_requests.labels(model, result)
        self.slo_attainment.labels(model).set(1.0)

    def request_done(self, status: int) -> None:
        self.requests.labels(self.model, str(status)).inc()

    def observe_gaps(self, gaps: list[float]) -> None:
        """Token gaps as they happen, not when their request ends: the planner's decode
        signal (TBT p90 over its last interval, operator/planner/signals.py) then shows a
        slow decoder within one interval instead of one request's duration later (25 s
        for 500 tokens at 50 ms)."""
        if gaps:
            child = self.tbt.labels(self.model)
            for g in gaps:
                child.observe(g)

    def record_completion(self, timer: RequestTimer) -> None:
        """A request that produced all its tokens (finish_reason set)."""
        if timer.first_token_at is None:
            return
        end = timer.last_token_at or timer.first_token_at
        ttft = timer.first_token_at - timer.start
        self.ttft.labels(self.model).observe(ttft)
        self.e2e.labels(self.model).observe(end - timer.start)
        if timer.num_tokens > 1:
            self.tpot.labels(self.model).observe((end - timer.first_token_at) / (timer.num_tokens - 1))
        met = meets_slo(ttft, timer.gaps, self.ttft_slo_s, self.tbt_slo_s)
        self.slo_requests.labels(self.model, "met" if met else "missed").inc()
        self._window.append(met)
        self.slo_attainment.labels(self.model).set(sum(self._window) / len(self._window))


@dataclass
class RequestTimer:
    """Token arrival times of one request, on the monotonic clock."""

    start: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    # Tokens the worker groups on purpose (a request taken whole, `stream_interval` in the
    # stage request): a group's wait is shared among its tokens, the decode's pace, rather
    # than one long gap and zeros that no client saw either.
    spread: bool = False

    def tokens(self, count: int, now: float | None = None) -> list[float]:
        """Record `count` tokens arriving now; returns the gaps they add."""
        if count <= 0:
            return []
        now = time.monotonic() if now is None else now
        if self.first_token_at is None:
            self.first_token_at = now
            new = [0.0] * (count - 1)
        elif self.spread:
            assert self.last_token_at is not None
            new = [(now - self.last_token_at) / count] * count
        else:
            assert self.last_token_at is not None
            new = [now - self.last_token_at] + [0.0] * (count - 1)
        self.gaps.extend(new)
        self.last_token_at = now
        self.num_tokens += count
        return new
