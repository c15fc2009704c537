"""SLO -> budget search (TriInfer §4.2 Alg. 1 lines 1-5) with injected cost functions."""

from __future__ import annotations

import random

import pytest

from triptych.slo_budgets import ProfilingError, latency_limit, search_budget
from triptych.topology import InstanceType


def test_binary_search_finds_the_exact_largest_budget() -> None:
    calls: list[int] = []

    def cost(b: int) -> float:  # 2 ms fixed + 0.1 ms per token
        calls.append(b)
        return 0.002 + 0.0001 * b

    assert search_budget(cost, 0.05025, 1, 8192) == 482
    assert len(calls) <= 14  # log2(8192) + 1
    assert search_budget(cost, 1e9, 1, 8192) == 8192  # everything fits: the cap
    assert search_budget(cost, 0.001, 1, 8192) == 0  # nothing fits: lo - 1


@pytest.mark.parametrize("seed", range(5))
def test_search_matches_a_linear_scan_on_random_monotone_costs(seed: int) -> None:
    rng = random.Random(seed)
    steps = [rng.random() for _ in range(300)]
    table = [sum(steps[: i + 1]) for i in range(300)]  # non-decreasing, with plateaus allowed

    def cost(b: int) -> float:
        return table[b - 1]

    for limit in [rng.uniform(0, table[-1] * 1.1) for _ in range(50)]:
        expected = max((b for b in range(1, 301) if cost(b) <= limit), default=0)
        assert search_budget(cost, limit, 1, 300) == expected


def test_tighter_slo_never_gives_a_larger_budget() -> None:
    def cost(b: int) -> float:  # a stepwise-superlinear step time, as batches spill caches
        return 0.004 + 0.00002 * b + (0.003 if b > 512 else 0.0) + 1e-8 * b * b

    rng = random.Random(7)
    slos = sorted(rng.uniform(0.001, 0.5) for _ in range(300))
    for role in InstanceType:
        budgets = [search_budget(cost, latency_limit(role, ttft_slo_s=s, tbt_slo_s=s), 1, 4096) for s in slos]
        assert budgets == sorted(budgets), role


def test_latency_limit_by_instance_type() -> None:
    for role in (InstanceType.E, InstanceType.EP, InstanceType.P):
        assert latency_limit(role, ttft_slo_s=2.0, tbt_slo_s=0.1) == pytest.approx(1.0)  # alpha * TTFT
    for role in (InstanceType.D, InstanceType.PD, InstanceType.ED, InstanceType.EPD):
        assert latency_limit(role, ttft_slo_s=2.0, tbt_slo_s=0.1) == pytest.approx(0.1)  # TBT
    with pytest.raises(ProfilingError, match="TTFT"):
        latency_limit(InstanceType.P, ttft_slo_s=None, tbt_slo_s=0.1)
    with pytest.raises(ProfilingError, match="TBT"):
        latency_limit(InstanceType.D, ttft_slo_s=1.0, tbt_slo_s=None)
