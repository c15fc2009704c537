"""Open-loop Poisson load against a running router: every rate of a plan (a list, or a
goodput sweep), each request timed from its SSE stream, the workers' /metrics scraped
before and after each rate for the EP/PD migration figures. The report's semantics
follow HydraInfer §2.3 (see stats.py). A client: it imports no torch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from triptych.bench.client import Endpoints, discover, scrape, send_request
from triptych.bench.errors import BenchError
from triptych.bench.exact_timings import timing_figures, timing_marks, timings_since
from triptych.bench.prom_text import Sample, metric_deltas, migration_figures
from triptych.bench.report import progress, rate_line
from triptych.bench.stats import SLO, RequestResult, goodput, next_sweep_rate, summarize
from triptych.bench.trace import calibrate, timed, trace_bodies
from triptych.bench.workload import Workload, build_bodies, poisson_arrivals
from triptych.operator.planner.workload import TraceRequest
from triptych.timings import TimingRecord


async def run_rate(client: httpx.AsyncClient, ends: Endpoints, bodies: Sequence[bytes], rate: float,
                   seed: int, slo: SLO, timeout_s: float, arrivals: Sequence[float] | None = None,
                   ) -> tuple[dict[str, Any], list[Sample], list[Sample]]:
    """Send `bodies` at Poisson arrivals of `rate`/s (or at `arrivals`, s from the start:
    a trace's); summary plus the metric scrapes taken before and after. The report keeps
    the exact timing records of the rate under `_timings` (exact_timings.py)."""
    arrivals = poisson_arrivals(rate, len(bodies), seed) if arrivals is None else arrivals
    marks = await timing_marks(client, ends.all, ends.admin_headers)
    before = await scrape(client, ends.all)
    url = f"{ends.router}/v1/chat/completions"
    t0 = time.perf_counter()

    async def one(at: float, body: bytes) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await send_request(client, url, body, timeout_s, ends.headers)

    results = await asyncio.gather(*(one(at, b) for at, b in zip(arrivals, bodies, strict=True)))
    duration = time.perf_counter() - t0
    after = await scrape(client, ends.all)
    records = await timings_since(client, marks, ends.admin_headers) if marks else None
    report = {"rate": rate, **summarize(results, slo, duration),
              **_migration_report(metric_deltas(before, after), records)}
    report["_results"] = results
    report["_timings"] = records
    return report, before, after


def _migration_report(deltas: Sequence[Sample], records: list[TimingRecord] | None) -> dict[str, Any]:
    """Migration and overhead figures: exact from the timing rings when they could be read,
    else the histogram estimates of /metrics (and no router overhead)."""
    figures = migration_figures(deltas)
    if records is None:
        return {**figures, "timings_source": "histogram", "router_overhead_p50_s": None}
    return {**figures, **timing_figures(records)}


@dataclass
class RunConfig:
    work: Workload
    slo: SLO
    rates: list[float]
    sweep: bool = False
    sweep_max_rate: float = 64.0
    sweep_steps: int = 2
    seed: int = 0
    timeout_s: float = 120.0
    warmup: int = 1  # requests sent one by one first, not counted (connections, first transfers)
    trace: list[TraceRequest] | None = None  # replay this (re-timed to each rate) instead of Poisson

    def check(self) -> None:
        self.work.check()
        self.slo.check()
        if self.warmup < 0:
            raise BenchError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise BenchError(f"rates must be > 0, got {self.rates}")
        if self.timeout_s <= 0 or self.sweep_steps < 0:
            raise BenchError("need --request-timeout > 0 and --sweep-steps >= 0")

    def rate_plan(self) -> Callable[[list[tuple[float, float | None]]], float | None]:
        """Given the (rate, attainment) points so far, the next rate to run (None: done)."""
        if self.sweep:
            return lambda pts: next_sweep_rate(pts, start=self.rates[0], max_rate=self.sweep_max_rate,
                                               refine_steps=self.sweep_steps, target=self.slo.target)
        return lambda pts: self.rates[len(pts)] if len(pts) < len(self.rates) else None


async def _warm_up(client: httpx.AsyncClient, ends: Endpoints, cfg: RunConfig, model: str) -> None:
    """A few requests before measuring, so the first rate does not pay for connection set-up
    and first NIXL transfers. A failure here stops the run: the router cannot serve."""
    if not cfg.warmup:
        return
    work = Workload(**{**asdict(cfg.work), "num_requests": cfg.warmup})
    for body in await asyncio.to_thread(build_bodies, work, model, cfg.seed - 1):
        r = await send_request(client, f"{ends.router}/v1/chat/completions", body, cfg.timeout_s, ends.headers)
        if not r.ok:
            raise BenchError(f"warm-up request failed: {r.error}")
    progress(f"warm-up: {cfg.warmup} request(s) ok")


async def run_bench(url: str, cfg: RunConfig, worker_urls: Sequence[str] = (),
                    headers: dict[str, str] | None = None,
                    admin_headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Run every rate of the plan against the router at `url`; the full report. With
    `admin_headers` (the admin token) the migration and overhead figures are exact."""
    cfg.check()
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False) as client:
        model, ends = await discover(client, url, worker_urls, headers or {})
        ends.admin_headers = dict(admin_headers or {})
        if not ends.workers:
            progress("warning: no worker URLs (router /health lists none; pass --worker-urls): "
                 "migration figures will be empty")
        await _warm_up(client, ends, cfg, model)
        scale = await calibrate(client, url, model, ends.headers) if cfg.trace else None
        if scale is not None:
            progress(f"trace: {len(cfg.trace or [])} requests; prompts at {scale.tokens_per_word:.2f} tokens "
                     f"per word (+{scale.template_tokens} template tokens)")
        plan = cfg.rate_plan()
        reports: list[dict[str, Any]] = []
        all_results: list[RequestResult] = []
        all_timings: list[TimingRecord] | None = []
        first_before: list[Sample] | None = None
        last_after: list[Sample] = []
        while (rate := plan([(r["rate"], r["slo_attainment"]) for r in reports])) is not None:
            # Fresh images per round: a repeated image would hit the embedding cache.
            seed = cfg.seed + 1000 * len(reports)
            arrivals = None
            if cfg.trace and scale is not None:
                replay = timed(cfg.trace, rate)
                arrivals = [r.t for r in replay]
                bodies = await asyncio.to_thread(trace_bodies, replay, model, seed, scale)
            else:
                bodies = await asyncio.to_thread(build_bodies, cfg.work, model, seed)
            progress(f"rate {rate:g} req/s: sending {len(bodies)} requests")
            report, before, last_after = await run_rate(client, ends, bodies, rate, cfg.seed + len(reports),
                                                        cfg.slo, cfg.timeout_s, arrivals)
            first_before = before if first_before is None else first_before
            all_results.extend(report.pop("_results"))
            timings = report.pop("_timings")
            all_timings = None if timings is None or all_timings is None else all_timings + timings
            reports.append(report)
            progress("  " + rate_line(report))
    duration = sum(r["duration_s"] for r in reports)
    pooled = summarize(all_results, cfg.slo, duration)
    points = [(r["rate"], r["slo_attainment"]) for r in reports]
    gp = goodput(points, cfg.slo.target)
    return {
        "url": url, "model": model, "workers": ends.workers,
        "workload": asdict(cfg.work) if not cfg.trace else {"trace_requests": len(cfg.trace)},
        "prompt_scale": asdict(scale) if scale is not None else None, "slo": asdict(cfg.slo), "seed": cfg.seed, "sweep": cfg.sweep,
        "goodput_rps": gp,
        # No failing rate above it was measured: the true goodput may be higher.
        "goodput_is_lower_bound": gp is not None and not any(r > gp for r, _ in points),
        "attainment_by_rate": {f"{r:g}": a for r, a in points},
        **pooled,
        **_migration_report(metric_deltas(first_before or [], last_after), all_timings if reports else None),
        "rates": reports,
    }


