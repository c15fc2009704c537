"""SLO-derived step budgets (TriInfer Alg. 1 lines 1-5), shared by the engine's start-up
profiler (worker/engine/profiler.py) and the planner's simulator (operator/planner/).
Torch-free: the operator imports it.

An instance whose work ends in a first token (E, EP, P) keeps each step under
alpha x the TTFT SLO; every decoding type keeps it under the TBT SLO. The budget is the
largest batch whose measured (or modelled) step time fits that limit."""

from __future__ import annotations

from collections.abc import Callable

from triptych.topology import InstanceType

ALPHA = 0.5
TTFT_TYPES = frozenset({InstanceType.E, InstanceType.EP, InstanceType.P})


class ProfilingError(ValueError):
    """The SLO this instance type derives its budgets from is missing."""


def latency_limit(role: InstanceType, ttft_slo_s: float | None, tbt_slo_s: float | None,
                  alpha: float = ALPHA) -> float:
    """The step-time limit of Alg. 1 lines 1-4."""
    if role in TTFT_TYPES:
        if ttft_slo_s is None:
            raise ProfilingError(f"a {role.value} instance derives its budgets from the TTFT SLO; none given")
        return alpha * ttft_slo_s
    if tbt_slo_s is None:
        raise ProfilingError(f"a {role.value} instance derives its budgets from the TBT SLO; none given")
    return tbt_slo_s


def search_budget(cost: Callable[[int], float], limit: float, lo: int = 1, hi: int = 8192) -> int:
    """Largest b in [lo, hi] with cost(b) <= limit, assuming cost is non-decreasing; lo - 1
    when even cost(lo) is over the limit. Calls cost O(log(hi - lo)) times."""
    if hi < lo:
        raise ValueError(f"empty search range [{lo}, {hi}]")
    best = lo - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if cost(mid) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best
