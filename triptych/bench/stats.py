"""Percentiles and the SLO math of the serving benchmark (pure).

HydraInfer §2.3 (paper 003): a request meets its SLO when TTFT <= TTFT SLO and 90% of its
token gaps <= TBT SLO; attainment is the share of requests meeting it (failed ones count
as missing it); goodput is the highest request rate with attainment >= 90%.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from triptych.bench.errors import BenchError

ATTAINMENT_TARGET = 0.9  # HydraInfer §2.3: goodput is the highest rate with attainment >= 90%
TBT_FRACTION = 0.9  # HydraInfer §2.3: 90% of a request's token gaps must be <= the TBT SLO


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
    request_id: str | None = None  # the router's X-Request-Id (the response's id)
    sent_at: float | None = None  # time.perf_counter() when it was sent (to line streams up)
    token_times: list[float] = field(default_factory=list)  # each output token's arrival

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
    return RequestResult(ttft=first_text, e2e=end, gaps=gaps, num_tokens=n, token_times=token_times)


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
