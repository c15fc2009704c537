"""`triptych bench serve`: open-loop Poisson load against a running router.

Sends synthetic multimodal chat requests (seeded PNG images and prompts) at given request
rates (or a rate sweep), measures per request TTFT, token gaps, TPOT and E2E from the
SSE stream, and reports per rate: latency percentiles, SLO attainment, throughput, and
the EP/PD migration times and bytes moved, read from the workers' Prometheus metrics
(scraped before and after each rate). Goodput is the highest rate whose attainment
reaches the target. Metric semantics follow HydraInfer §2.3 (paper 003): a request meets
its SLO when TTFT <= TTFT SLO and 90% of its token gaps <= TBT SLO; attainment is the share
of requests meeting it; goodput the highest request rate with attainment >= 90%.

`--topologies EPD,1E1P1D,1EP1D` starts each topology in turn as a local deployment and
runs the same request set against each. This module is a client: it imports no torch
(only `--measure-nixl` and `--topologies` import worker-side code, lazily).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ATTAINMENT_TARGET = 0.9  # HydraInfer §2.3: goodput is the highest rate with attainment >= 90%
TBT_FRACTION = 0.9  # HydraInfer §2.3: 90% of a request's token gaps must be <= the TBT SLO


class BenchError(ValueError):
    """Bad benchmark input, or a router/worker that cannot be benchmarked (unreachable...)."""


# --- statistics (pure) ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise BenchError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RequestResult:
    """What one request measured. Times are seconds from the moment it was sent."""

    ttft: float | None = None  # first chunk with content
    e2e: float | None = None  # end of the stream
    gaps: list[float] = field(default_factory=list)  # between consecutive output tokens
    num_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (n - 1): mean time per output token after the first."""
        if not self.ok or self.num_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_tokens - 1)  # type: ignore[operator]


def timeline_result(events: Sequence[tuple[float, int, bool]], end: float,
                    num_tokens: int | None = None) -> RequestResult:
    """Build a result from a stream's timeline: `(t, tokens, has_text)` per chunk, `t`
    seconds since the request was sent, `tokens` the output tokens that chunk delivered.
    A chunk delivering k tokens contributes one gap (since the previous token) and k-1
    zero gaps: those tokens reached the client together. `num_tokens` (the usage count)
    defaults to the tokens seen."""
    first_text = next((t for t, _, text in events if text), None)
    token_times = [t for t, k, _ in events for _ in range(k)]
    if first_text is None and token_times:
        first_text = token_times[0]  # tokens that decode to no text still arrived
    if first_text is None:
        return RequestResult(e2e=end, error="no output tokens")
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    n = num_tokens if num_tokens is not None else len(token_times)
    return RequestResult(ttft=first_text, e2e=end, gaps=gaps, num_tokens=n)


def meets_slo(result: RequestResult, ttft_slo: float, tbt_slo: float,
              fraction: float = TBT_FRACTION) -> bool:
    """HydraInfer §2.3: TTFT <= TTFT SLO and at least `fraction` of the token gaps <= TBT
    SLO. A failed request never meets it; one with no gaps (one token) needs only TTFT."""
    if not result.ok or result.ttft > ttft_slo:  # type: ignore[operator]
        return False
    within = sum(1 for g in result.gaps if g <= tbt_slo)
    return within >= fraction * len(result.gaps) - 1e-9


def slo_attainment(results: Sequence[RequestResult], ttft_slo: float, tbt_slo: float,
                   fraction: float = TBT_FRACTION) -> float | None:
    """Share of requests (all sent, failed ones included) that met their SLO."""
    if not results:
        return None
    return sum(meets_slo(r, ttft_slo, tbt_slo, fraction) for r in results) / len(results)


def goodput(points: Iterable[tuple[float, float | None]], target: float = ATTAINMENT_TARGET) -> float | None:
    """HydraInfer §2.3: the highest request rate whose attainment reached `target`; None
    when no measured rate did."""
    passing = [rate for rate, att in points if att is not None and att >= target]
    return max(passing, default=None)


def next_sweep_rate(points: Sequence[tuple[float, float | None]], *, start: float, max_rate: float,
                    refine_steps: int, target: float = ATTAINMENT_TARGET) -> float | None:
    """The next rate of a goodput sweep, None when done. Doubles from `start` while the
    attainment holds (up to `max_rate`), then bisects between the highest passing and
    the lowest failing rate `refine_steps` times (from 0 if even `start` fails)."""
    if not points:
        return start
    ok = [r for r, a in points if a is not None and a >= target]
    lo = max(ok, default=0.0)
    above = [r for r, a in points if (a is None or a < target) and r > lo]
    if not above:
        nxt = lo * 2
        return nxt if nxt <= max_rate + 1e-9 else None
    first_fail = next(i for i, (_, a) in enumerate(points) if a is None or a < target)
    if len(points) - first_fail - 1 >= refine_steps:
        return None
    nxt = (lo + min(above)) / 2
    return None if any(math.isclose(nxt, r) for r, _ in points) else nxt


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s from the start) of n requests of a Poisson process at `rate`/s: the
    first at 0, then exponential gaps. `rate=inf` sends all at once."""
    if n < 0 or not rate > 0:
        raise BenchError(f"need n >= 0 and rate > 0, got n={n}, rate={rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


# --- Prometheus histograms and counters (pure) ----------------------------------------------

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
    return out


# --- the synthetic workload ----------------------------------------------------------------

WORDS = tuple("""
the a of and to in is was for on that with as by at from this be it are an or which one all
image picture photo scene color light shadow left right top bottom center object person animal
tree house car road sky water mountain city street table chair window door red blue green
yellow black white small large bright dark near far describe explain count list compare what
where why how many several each every first second last above below behind between inside
""".split())


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    images_per_request: int = 1
    image_size: tuple[int, int] = (64, 64)  # width, height
    prompt_len: int = 32  # words
    output_len: int = 16  # tokens (max_tokens, with ignore_eos)

    def check(self) -> None:
        w, h = self.image_size
        if self.num_requests < 1 or self.images_per_request < 0 or self.prompt_len < 1 or self.output_len < 1:
            raise BenchError("need num_requests >= 1, images_per_request >= 0, prompt_len >= 1, output_len >= 1")
        if w < 1 or h < 1:
            raise BenchError(f"image size must be positive, got {w}x{h}")


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


def make_image_data_url(rng: random.Random, width: int, height: int) -> str:
    """A seeded PNG: an 8x8 grid of random colours scaled up (unique per seed, so no two
    requests share an embedding-cache entry, and small as PNG)."""
    from PIL import Image

    grid = Image.frombytes("RGB", (8, 8), rng.randbytes(8 * 8 * 3))
    buf = io.BytesIO()
    grid.resize((width, height), Image.Resampling.NEAREST).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def build_bodies(work: Workload, model: str, seed: int) -> list[bytes]:
    """The JSON bodies of the request set (built before sending, so encoding images does
    not delay arrivals)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(work.num_requests):
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": make_image_data_url(rng, *work.image_size)}}
            for _ in range(work.images_per_request)]
        parts.append({"type": "text", "text": make_prompt(rng, work.prompt_len)})
        body = {"model": model, "messages": [{"role": "user", "content": parts}],
                "max_tokens": work.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        bodies.append(json.dumps(body).encode())
    return bodies


# --- the client ----------------------------------------------------------------------------


def _chunk_event(obj: dict[str, Any], seen: int) -> tuple[int, bool, int | None]:
    """(tokens delivered, has text, cumulative usage count) of one SSE chunk."""
    text = "".join(((c.get("delta") or {}).get("content") or c.get("text") or "")
                   for c in obj.get("choices") or [])
    usage = obj.get("usage") or None
    total = usage.get("completion_tokens") if usage else None
    if total is not None:
        return max(0, total - seen), bool(text), total
    return (1 if text else 0), bool(text), None


async def send_request(client: httpx.AsyncClient, url: str, body: bytes, timeout_s: float,
                       headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming request and time its chunks. Never raises: failures are in
    `.error` (HTTP status, error event, timeout, connection error)."""
    start = time.perf_counter()
    events: list[tuple[float, int, bool]] = []
    seen, usage_total = 0, None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, content=body,
                                     headers={"content-type": "application/json", **(headers or {})}) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    return RequestResult(error=f"HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        return RequestResult(error=f"stream error: {obj['error'].get('message', obj['error'])}")
                    now = time.perf_counter() - start
                    tokens, has_text, total = _chunk_event(obj, seen)
                    if total is not None:
                        usage_total = total
                    if tokens or has_text:
                        events.append((now, tokens, has_text))
                        seen += tokens
    except TimeoutError:
        return RequestResult(error=f"timeout after {timeout_s:.0f}s")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}")
    return timeline_result(events, time.perf_counter() - start, usage_total)


@dataclass
class Endpoints:
    router: str
    workers: list[str]
    headers: dict[str, str]

    @property
    def all(self) -> list[str]:
        return [self.router, *self.workers]


async def scrape(client: httpx.AsyncClient, urls: Sequence[str]) -> list[Sample]:
    """All samples of every URL's /metrics; a URL that does not answer is skipped (its
    figures are then missing from the report, which says so with a count of 0)."""
    async def one(url: str) -> list[Sample]:
        try:
            resp = await client.get(f"{url}/metrics", timeout=10.0)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            print(f"warning: could not scrape {url}/metrics: {exc}", file=sys.stderr)
            return []
        # One process's samples stay apart from another's: tag them with the instance.
        return [(n, (*labels, ("__instance", url)), v) for n, labels, v in parse_metrics(resp.text)]
    parts = await asyncio.gather(*(one(u) for u in urls))
    return [s for part in parts for s in part]


async def discover(client: httpx.AsyncClient, url: str, worker_urls: Sequence[str],
                   headers: dict[str, str]) -> tuple[str, Endpoints]:
    """The served model name (from /v1/models) and the worker URLs: `--worker-urls`, plus
    any the router's /health lists under `instances` or `workers`."""
    try:
        resp = await client.get(f"{url}/v1/models", headers=headers, timeout=10.0)
        resp.raise_for_status()
        model = resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"no model list at {url}/v1/models: {exc}") from exc
    found = list(worker_urls)
    try:
        health = (await client.get(f"{url}/health", timeout=10.0)).json()
    except (httpx.HTTPError, ValueError):
        health = {}
    for key in ("instances", "workers"):
        for item in health.get(key) or []:
            u = item.get("url") if isinstance(item, dict) else item
            if isinstance(u, str) and u.rstrip("/") not in found:
                found.append(u.rstrip("/"))
    return model, Endpoints(url, [u.rstrip("/") for u in found], headers)


# --- one rate ------------------------------------------------------------------------------


@dataclass
class SLO:
    ttft_s: float = 2.0
    tbt_s: float = 0.2
    target: float = ATTAINMENT_TARGET

    def check(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0 and 0 < self.target <= 1):
            raise BenchError(f"need ttft/tbt SLOs > 0 and 0 < target <= 1, got {self}")


def _pcts(prefix: str, values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    return {f"{prefix}_p{q}_s": percentile(values, q) for q in qs}


def summarize(results: Sequence[RequestResult], slo: SLO, duration_s: float) -> dict[str, Any]:
    """Latency percentiles, attainment and throughput of one set of requests."""
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    out: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": sum(r.num_tokens for r in ok) / duration_s if duration_s > 0 else None,
        "slo_attainment": slo_attainment(results, slo.ttft_s, slo.tbt_s),
        **_pcts("ttft", [r.ttft for r in ok]),  # type: ignore[misc]
        **_pcts("tpot", [r.tpot for r in ok if r.tpot is not None]),  # type: ignore[misc]
        **_pcts("e2e", [r.e2e for r in ok]),  # type: ignore[misc]
        **_pcts("tbt", gaps),
    }
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


async def run_rate(client: httpx.AsyncClient, ends: Endpoints, bodies: Sequence[bytes], rate: float,
                   seed: int, slo: SLO, timeout_s: float) -> tuple[dict[str, Any], list[Sample], list[Sample]]:
    """Send `bodies` at Poisson arrivals of `rate`/s; summary plus the metric scrapes
    taken before and after."""
    arrivals = poisson_arrivals(rate, len(bodies), seed)
    before = await scrape(client, ends.all)
    url = f"{ends.router}/v1/chat/completions"
    t0 = time.perf_counter()

    async def one(at: float, body: bytes) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        return await send_request(client, url, body, timeout_s, ends.headers)

    results = await asyncio.gather(*(one(at, b) for at, b in zip(arrivals, bodies, strict=True)))
    duration = time.perf_counter() - t0
    after = await scrape(client, ends.all)
    report = {"rate": rate, **summarize(results, slo, duration), **migration_figures(metric_deltas(before, after))}
    report["_results"] = results
    return report, before, after


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


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    _log(f"warm-up: {cfg.warmup} request(s) ok")


async def run_bench(url: str, cfg: RunConfig, worker_urls: Sequence[str] = (),
                    headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Run every rate of the plan against the router at `url`; the full report."""
    cfg.check()
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False) as client:
        model, ends = await discover(client, url, worker_urls, headers or {})
        if not ends.workers:
            _log("warning: no worker URLs (router /health lists none; pass --worker-urls): "
                 "migration figures will be empty")
        await _warm_up(client, ends, cfg, model)
        plan = cfg.rate_plan()
        reports: list[dict[str, Any]] = []
        all_results: list[RequestResult] = []
        first_before: list[Sample] | None = None
        last_after: list[Sample] = []
        while (rate := plan([(r["rate"], r["slo_attainment"]) for r in reports])) is not None:
            # Fresh images per round: a repeated image would hit the embedding cache.
            bodies = await asyncio.to_thread(build_bodies, cfg.work, model, cfg.seed + 1000 * len(reports))
            _log(f"rate {rate:g} req/s: sending {len(bodies)} requests")
            report, before, last_after = await run_rate(client, ends, bodies, rate, cfg.seed + len(reports),
                                                        cfg.slo, cfg.timeout_s)
            first_before = before if first_before is None else first_before
            all_results.extend(report.pop("_results"))
            reports.append(report)
            _log("  " + _rate_line(report))
    duration = sum(r["duration_s"] for r in reports)
    pooled = summarize(all_results, cfg.slo, duration)
    points = [(r["rate"], r["slo_attainment"]) for r in reports]
    gp = goodput(points, cfg.slo.target)
    return {
        "url": url, "model": model, "workers": ends.workers,
        "workload": asdict(cfg.work), "slo": asdict(cfg.slo), "seed": cfg.seed, "sweep": cfg.sweep,
        "goodput_rps": gp,
        # No failing rate above it was measured: the true goodput may be higher.
        "goodput_is_lower_bound": gp is not None and not any(r > gp for r, _ in points),
        "attainment_by_rate": {f"{r:g}": a for r, a in points},
        **pooled,
        **migration_figures(metric_deltas(first_before or [], last_after)),
        "rates": reports,
    }


# --- output --------------------------------------------------------------------------------


def _fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v * scale:.{digits}f}"
    return str(v)


def _rate_line(r: dict[str, Any]) -> str:
    return (f"attainment {_fmt(r['slo_attainment'], 100, 1)}%  ok {r['completed']}/{r['num_requests']}  "
            f"TTFT p50/p99 {_fmt(r['ttft_p50_s'])}/{_fmt(r['ttft_p99_s'])} s  "
            f"TPOT p50/p99 {_fmt(r['tpot_p50_s'], 1e3, 1)}/{_fmt(r['tpot_p99_s'], 1e3, 1)} ms  "
            f"{_fmt(r['throughput_rps'], 1, 2)} req/s")


RATE_COLUMNS = (
    ("rate", "rate", 1, 2), ("ok", "completed", 1, 0), ("attain%", "slo_attainment", 100, 1),
    ("ttft50", "ttft_p50_s", 1, 3), ("ttft90", "ttft_p90_s", 1, 3), ("ttft99", "ttft_p99_s", 1, 3),
    ("tpot50ms", "tpot_p50_s", 1e3, 1), ("tpot90ms", "tpot_p90_s", 1e3, 1), ("tpot99ms", "tpot_p99_s", 1e3, 1),
    ("e2e50", "e2e_p50_s", 1, 3), ("e2e99", "e2e_p99_s", 1, 3), ("req/s", "throughput_rps", 1, 2),
    ("tok/s", "output_tokens_per_s", 1, 1), ("ep50ms", "ep_migration_p50_s", 1e3, 2),
    ("ep95ms", "ep_migration_p95_s", 1e3, 2), ("pd50ms", "pd_migration_p50_s", 1e3, 2),
    ("pd95ms", "pd_migration_p95_s", 1e3, 2), ("MiB", "transfer_bytes_total", 2**-20, 2),
)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, float, int]],
          label: tuple[str, str] | None = None) -> str:
    cols = ([(label[0], label[1], 1.0, 0)] if label else []) + list(columns)
    cells = [[h for h, *_ in cols]]
    for row in rows:
        line = []
        for _, key, scale, digits in cols:
            v = row.get(key)
            line.append(_fmt(float(v) if isinstance(v, int) and scale != 1 else v, scale, digits))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)


def format_report(rep: dict[str, Any]) -> str:
    slo = rep["slo"]
    lines = [f"model {rep['model']} at {rep['url']}; workers scraped: {len(rep['workers'])}",
             f"SLO: TTFT <= {slo['ttft_s']} s, {TBT_FRACTION:.0%} of token gaps <= {slo['tbt_s']} s "
             f"(HydraInfer §2.3); times in s unless ms", "",
             table(rep["rates"], RATE_COLUMNS), ""]
    gp = rep["goodput_rps"]
    lines.append(f"goodput (highest rate with attainment >= {slo['target']:.0%}): "
                 + ("none" if gp is None else f"{gp:g} req/s" + (" (lower bound)" if rep["goodput_is_lower_bound"]
                                                                else "")))
    lines.append(f"all rates: attainment {_fmt(rep['slo_attainment'], 100, 1)}%, "
                 f"EP migration p50/p95 {_fmt(rep['ep_migration_p50_s'], 1e3, 2)}/"
                 f"{_fmt(rep['ep_migration_p95_s'], 1e3, 2)} ms ({rep['ep_migrations']}), "
                 f"PD migration p50/p95 {_fmt(rep['pd_migration_p50_s'], 1e3, 2)}/"
                 f"{_fmt(rep['pd_migration_p95_s'], 1e3, 2)} ms ({rep['pd_migrations']}), "
                 f"transports {rep['migration_transports'] or '-'}")
    for key, nbytes in rep["transfer_bytes"].items():
        lines.append(f"  moved {nbytes / 2**20:.2f} MiB ({key})")
    if "nixl_read_gib_s" in rep:
        lines.append(f"raw NIXL READ bandwidth: {_fmt(rep['nixl_read_gib_s'], 1, 2)} GiB/s "
                     f"({rep.get('nixl_read_error') or str(rep['nixl_read_mib']) + ' MiB reads'})")
    return "\n".join(lines)


def plot_attainment(series: dict[str, Sequence[tuple[float, float | None]]], path: Path,
                    target: float = ATTAINMENT_TARGET) -> None:
    """Attainment vs request rate, one line per series, the target as a dashed line and
    each series' goodput as a dotted vertical (HydraInfer Fig. 10 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":")]  # series that coincide stay visible
    for i, (label, points) in enumerate(series.items()):
        pts = sorted((r, a) for r, a in points if a is not None)
        marker, style = styles[i % len(styles)]
        line, = ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], marker=marker, linestyle=style,
                        markersize=7 - i % len(styles), label=label)
        gp = goodput(pts, target)
        if gp is not None:
            ax.axvline(gp, color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(target * 100, color="gray", linestyle="--", linewidth=1, label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """NIXL logs to fd 1 (here and in the source peer's child process); `--json` must
    keep stdout to the one JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def measure_nixl(mib: int, iters: int = 10) -> dict[str, Any]:
    """Raw loopback NIXL READ bandwidth (imports torch and the worker's transfer code)."""
    if mib < 1 or iters < 1:
        raise BenchError(f"need --nixl-mib >= 1 and iters >= 1, got {mib}, {iters}")
    try:
        with _stdout_to_stderr():
            from triptych.worker.transfer.bandwidth import measure_read_bandwidth

            bps = measure_read_bandwidth(mib << 20, iters, require="nixl")
        return {"nixl_read_gib_s": bps / 2**30, "nixl_read_mib": mib, "nixl_read_iters": iters}
    except Exception as exc:  # report, don't lose the serving figures over it
        return {"nixl_read_gib_s": None, "nixl_read_mib": mib, "nixl_read_error": f"{type(exc).__name__}: {exc}"}


# --- topologies: the same request set against several local deployments ---------------------

TOPOLOGY_COLUMNS = (
    ("goodput", "goodput_rps", 1, 2), ("attain%", "slo_attainment", 100, 1), ("ok", "completed", 1, 0),
    ("ttft50", "ttft_p50_s", 1, 3), ("ttft99", "ttft_p99_s", 1, 3), ("tpot50ms", "tpot_p50_s", 1e3, 1),
    ("tpot99ms", "tpot_p99_s", 1e3, 1), ("e2e50", "e2e_p50_s", 1, 3), ("req/s", "throughput_rps", 1, 2),
    ("ep95ms", "ep_migration_p95_s", 1e3, 2), ("pd95ms", "pd_migration_p95_s", 1e3, 2),
    ("MiB", "transfer_bytes_total", 2**-20, 2),
)


def run_topologies(specs: Sequence[str], model: str, cfg: RunConfig, transfer_require: str,
                   log_dir: Path | None) -> dict[str, Any]:
    """Start each topology with LocalDeployment, run the same plan against it, stop it."""
    from triptych.local import LocalDeployment, resolve_model
    from triptych.topology import TopologyError, parse_topology

    try:
        parsed = {spec: parse_topology(spec) for spec in specs}
    except TopologyError as exc:
        raise BenchError(str(exc)) from exc
    model_dir = resolve_model(model)
    out: dict[str, Any] = {}
    for spec, topology in parsed.items():
        _log(f"== {spec}: starting local deployment of {model_dir.name}")
        dep = LocalDeployment(model=model_dir, topology=topology, transfer_require=transfer_require,
                              log_dir=log_dir / spec if log_dir else None)
        with dep:
            out[spec] = asyncio.run(run_bench(dep.router_url, cfg, [w.url for w in dep.workers]))
    return out


# --- CLI -----------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        work=Workload(num_requests=args.num_requests, images_per_request=args.images_per_request,
                      image_size=tuple(args.image_size), prompt_len=args.prompt_len,  # type: ignore[arg-type]
                      output_len=args.output_len),
        slo=SLO(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo, target=getattr(args, "attainment_target", 0.9)),
        rates=list(args.rates), sweep=getattr(args, "sweep", False),
        sweep_max_rate=getattr(args, "sweep_max_rate", 64.0), sweep_steps=getattr(args, "sweep_steps", 2),
        seed=args.seed, timeout_s=getattr(args, "request_timeout", 120.0), warmup=getattr(args, "warmup", 1))


def _write_outputs(args: argparse.Namespace, result: dict[str, Any], series: dict[str, Any], text: str,
                   target: float) -> None:
    if getattr(args, "plot", None):
        plot_attainment(series, Path(args.plot), target)
        _log(f"wrote {args.plot}")
    if getattr(args, "out_json", None):
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
        _log(f"wrote {args.out_json}")
    print(json.dumps(result, indent=2) if args.json else text)


def cli_main(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        cfg.check()
        topologies = [t for t in (getattr(args, "topologies", None) or "").split(",") if t.strip()]
        if bool(topologies) == bool(args.url):
            raise BenchError("give either --url (a running router) or --topologies (start each locally)")
        headers = {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else {}
        if topologies:
            log_dir = Path(args.log_dir) if getattr(args, "log_dir", None) else None
            per = run_topologies([t.strip() for t in topologies], args.model, cfg,
                                 getattr(args, "transfer_require", "nixl"), log_dir)
            result: dict[str, Any] = {"topologies": per}
            series = {spec: [(r["rate"], r["slo_attainment"]) for r in rep["rates"]] for spec, rep in per.items()}
            rows = [{"topology": spec, **rep} for spec, rep in per.items()]
            text = table(rows, TOPOLOGY_COLUMNS, label=("topology", "topology"))
        else:
            result = asyncio.run(run_bench(args.url, cfg, getattr(args, "worker_urls", None) or [], headers))
            series = {"attainment": [(r["rate"], r["slo_attainment"]) for r in result["rates"]]}
            text = ""
        if getattr(args, "measure_nixl", False):
            result.update(measure_nixl(getattr(args, "nixl_mib", 64)))
        if not topologies:
            text = format_report(result)
        elif "nixl_read_gib_s" in result:
            text += (f"\n\nraw NIXL READ bandwidth: {_fmt(result['nixl_read_gib_s'], 1, 2)} GiB/s "
                     f"({result.get('nixl_read_error') or str(result['nixl_read_mib']) + ' MiB reads'})")
        _write_outputs(args, result, series, text, cfg.slo.target)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
