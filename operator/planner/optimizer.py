"""The offline optimizer: the best hybrid method and instance ratio for N instances.

TriInfer Alg. 2 (paper 001 §4.4) with EPDServe §3.2.3's simulator-in-the-loop: from the
workload's per-request work and the SLO-derived budgets, an analytic bound ranks every
ratio of every method (capacity.py, O(N) per method); the best few ratios of each method
form the short list; the simulator replays the workload on each and measures its goodput
(HydraInfer §2.3); the highest goodput wins.

Deployments larger than `sim_instances` are simulated as a proportional slice (the
router spreads each stage evenly, so instances of one type are interchangeable): the
slice's goodput is scaled by the ratio of the analytic bounds of the full deployment and
the slice, which also corrects for the rounding of the slice's counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import BaseModel, Field

from triptych.operator.planner.capacity import METHODS, best_ratios, stage_costs
from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.simulator import (
    ATTAINMENT_TARGET,
    CompiledTrace,
    SimConfig,
    capped,
    goodput,
    simulate,
)
from triptych.operator.planner.workload import TraceRequest, WorkloadStats, resample, stats
from triptych.topology import InstanceType, format_topology


class Candidate(BaseModel):
    method: str
    topology: str
    counts: dict[str, int]
    bound_rps: float = Field(description="analytic capacity bound (TriInfer Alg. 2 lines 1-12)")
    goodput_rps: float | None = Field(None, description="simulated; None when pruned before simulation")
    simulated_topology: str | None = Field(None, description="the slice simulated, when smaller than topology")

    def kinds(self) -> dict[InstanceType, int]:
        return {InstanceType(k): v for k, v in self.counts.items()}


class PlanResult(BaseModel):
    instances: int
    method: str
    topology: str
    counts: dict[str, int]
    predicted_goodput_rps: float
    predicted_attainment: float = Field(description="simulated at the workload's own rate")
    workload: WorkloadStats
    ttft_slo_s: float
    tbt_slo_s: float
    profile: str
    ranking: list[Candidate] = Field(description="simulated candidates by goodput, then pruned ones by bound")
    searched: int = Field(description="ratios the analytic search covers (for three types, the best P:D split "
                                      "of each E count is derived from the bound rather than enumerated)")
    simulated: int = Field(description="candidates simulated")
    simulations: int = Field(description="simulator runs in all")
    elapsed_s: float


class PlanConfig(BaseModel):
    keep_per_method: int = Field(2, ge=1, description="ratios of each method simulated (the short list)")
    methods: list[str] = Field(default_factory=lambda: list(METHODS))
    sim_instances: int = Field(16, ge=1, description="simulate larger deployments as a slice of this size")
    min_duration_s: float = Field(15.0, gt=0, description="arrivals per simulated run, in seconds")
    max_requests: int | None = Field(None, ge=1, description="at most this many arrivals per simulated run "
                                     "(a live replan's time bound; None: min_duration_s alone)")
    step: float = Field(1.03, gt=1, description="goodput grid ratio")
    target: float = ATTAINMENT_TARGET
    pruned_in_ranking: int = Field(10, ge=0)
    confirm_top: int = Field(3, ge=1, description="re-measure this many leaders on bootstrap replicas")
    confirm_replicas: int = Field(2, ge=0, description="bootstrap replicas of the trace per leader")
    seed: int = 0


def plan(profile: StepProfile, trace: Sequence[TraceRequest], instances: int, sim: SimConfig,
         cfg: PlanConfig | None = None) -> PlanResult:
    cfg = cfg or PlanConfig()
    t0 = time.perf_counter()
    unknown = set(cfg.methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    w = stats(trace)
    costs = stage_costs(profile, w, sim.ttft_slo_s, sim.tbt_slo_s, sim.alpha)
    compiled = CompiledTrace(trace, profile)
    shortlist, pruned, searched = [], [], 0
    for method in cfg.methods:
        ranked = best_ratios(method, instances, costs, keep=cfg.keep_per_method + cfg.pruned_in_ranking)
        searched += _ratio_count(method, instances)
        for i, counts in enumerate(ranked):
            cand = Candidate(method=method, topology=format_topology(counts),
                             counts={k.value: v for k, v in counts.items()}, bound_rps=costs.bound(counts))
            (shortlist if i < cfg.keep_per_method else pruned).append(cand)
    if not shortlist:
        raise ValueError(f"{instances} instances are too few for methods {cfg.methods}")
    runs, by_slice = 0, {}
    for cand in shortlist:
        counts, scale = _slice(cand.kinds(), instances, cfg.sim_instances, costs)
        key = format_topology(counts)
        if scale != 1.0:
            cand.simulated_topology = key
        if key not in by_slice:  # neighbouring ratios of a large deployment may share one slice
            g = goodput(counts, profile, compiled, sim, cand.bound_rps / scale, target=cfg.target, step=cfg.step,
                        min_duration_s=cfg.min_duration_s, max_requests=cfg.max_requests)
            by_slice[key] = g.goodput_rps
            runs += g.simulations
        cand.goodput_rps = by_slice[key] * scale
    shortlist.sort(key=lambda c: (-(c.goodput_rps or 0.0), -c.bound_rps))
    runs += _confirm(shortlist[:cfg.confirm_top], profile, trace, sim, cfg, instances, costs)
    shortlist.sort(key=lambda c: (-(c.goodput_rps or 0.0), -c.bound_rps))
    best = shortlist[0]
    counts, scale = _slice(best.kinds(), instances, cfg.sim_instances, costs)
    rate = w.rate / scale
    arrivals = capped(max(len(trace), int(rate * cfg.min_duration_s)), cfg.max_requests)
    at_rate = simulate(counts, profile, compiled.at(rate, arrivals), sim)
    pruned.sort(key=lambda c: -c.bound_rps)
    return PlanResult(
        instances=instances, method=best.method, topology=best.topology, counts=best.counts,
        predicted_goodput_rps=best.goodput_rps or 0.0, predicted_attainment=at_rate.slo_attainment,
        workload=w, ttft_slo_s=sim.ttft_slo_s, tbt_slo_s=sim.tbt_slo_s, profile=profile.source,
        ranking=shortlist + pruned[:cfg.pruned_in_ranking], searched=searched, simulated=len(shortlist),
        simulations=runs + 1, elapsed_s=time.perf_counter() - t0)


def evaluate(profile: StepProfile, trace: Sequence[TraceRequest], counts: dict[InstanceType, int], sim: SimConfig,
             cfg: PlanConfig | None = None) -> float:
    """Simulated goodput of one deployment on the workload (the current plan, for a Proposal)."""
    cfg = cfg or PlanConfig()
    w = stats(trace)
    costs = stage_costs(profile, w, sim.ttft_slo_s, sim.tbt_slo_s, sim.alpha)
    n = sum(counts.values())
    small, scale = _slice(counts, n, cfg.sim_instances, costs)
    bound = costs.bound(counts)
    guess = bound / scale if bound not in (0.0, float("inf")) else max(w.rate, 1.0)
    g = goodput(small, profile, CompiledTrace(trace, profile), sim, guess, target=cfg.target, step=cfg.step,
                min_duration_s=cfg.min_duration_s, max_requests=cfg.max_requests)
    return g.goodput_rps * scale


def _confirm(leaders: list[Candidate], profile: StepProfile, trace: Sequence[TraceRequest], sim: SimConfig,
             cfg: PlanConfig, instances: int, costs) -> int:  # type: ignore[no-untyped-def]
    """Leaders often differ by a few percent, less than one trace realization's noise:
    average each leader's goodput over bootstrap replicas (common to all leaders)."""
    if cfg.confirm_replicas == 0 or len(leaders) < 2:
        return 0
    replicas = [CompiledTrace(resample(trace, cfg.seed + 1000 + i), profile) for i in range(cfg.confirm_replicas)]
    runs = 0
    for cand in leaders:
        counts, scale = _slice(cand.kinds(), instances, cfg.sim_instances, costs)
        total = cand.goodput_rps or 0.0
        for rep in replicas:
            g = goodput(counts, profile, rep, sim, (cand.goodput_rps or cand.bound_rps) / scale,
                        target=cfg.target, step=cfg.step, min_duration_s=cfg.min_duration_s,
                        max_requests=cfg.max_requests)
            total += g.goodput_rps * scale
            runs += g.simulations
        cand.goodput_rps = total / (1 + len(replicas))
    return runs


def _ratio_count(method: str, n: int) -> int:
    k = len(METHODS[method])
    if k == 1:
        return 1
    return n - 1 if k == 2 else max(0, (n - 1) * (n - 2) // 2)


def _slice(counts: dict[InstanceType, int], n: int, cap: int, costs) -> tuple[dict[InstanceType, int], float]:  # type: ignore[no-untyped-def]
    """A proportional slice of at most `cap` instances and the factor its goodput scales by."""
    if n <= cap:
        return counts, 1.0
    small = {k: max(1, round(v * cap / n)) for k, v in counts.items()}
    return small, costs.bound(counts) / costs.bound(small)
