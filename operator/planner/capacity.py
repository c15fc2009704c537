"""Analytic capacity bounds of a hybrid method and instance ratio (TriInfer Alg. 2 lines 1-12).

Per request the workload asks for W_e images, W_p prefill tokens (text + visual) and W_d
decode tokens. An instance of a type serves a stage at the throughput of a full batch under
that type's SLO-derived budgets (Alg. 1): tp_e images/s, tp_p tokens/s, tp_d tokens/s with
the decode batch capped by the KV cache (Alg. 2 line 9) and the engine's max_num_seqs.
A type running several stages shares its time between them, so a deployment sustains

    min over types T of  n_T / sum_{s in T} (W_s / tp_s(T))   requests/s

when the router spreads every stage evenly over the instances that run it. This is the
bound the optimizer prunes with; the simulator decides among the short list.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.workload import WorkloadStats
from triptych.slo_budgets import latency_limit
from triptych.topology import InstanceType, Stage

# The hybrid methods of TriInfer §4.4 / HydraInfer Fig. 12, plus E+PD and the aggregated EPD.
METHODS: dict[str, tuple[InstanceType, ...]] = {
    "E+P+D": (InstanceType.E, InstanceType.P, InstanceType.D),
    "EP+D": (InstanceType.EP, InstanceType.D),
    "ED+P": (InstanceType.ED, InstanceType.P),
    "E+PD": (InstanceType.E, InstanceType.PD),
    "EPD": (InstanceType.EPD,),
}


@dataclass(frozen=True)
class StageCosts:
    """Instance-seconds one request costs each instance type (per stage it runs)."""

    per_type: dict[InstanceType, float]

    def bound(self, counts: dict[InstanceType, int]) -> float:
        rates = [n / self.per_type[t] for t, n in counts.items() if n > 0 and self.per_type[t] > 0]
        if any(n <= 0 for n in counts.values()):
            return 0.0
        return min(rates) if rates else float("inf")


def stage_costs(profile: StepProfile, w: WorkloadStats, ttft_slo_s: float, tbt_slo_s: float,
                alpha: float = 0.5) -> StageCosts:
    pixels = w.image_pixels or 448 * 448
    shape = profile.shape
    visual = w.images_per_request * shape.tokens_per_image(int(pixels ** 0.5), int(pixels ** 0.5))
    work = {Stage.ENCODE: w.images_per_request, Stage.PREFILL: w.prompt_tokens + visual,
            Stage.DECODE: max(0.0, w.output_tokens - 1)}
    ctx = w.prompt_tokens + visual + w.output_tokens / 2

    @cache
    def throughput(kind: InstanceType, stage: Stage) -> float:
        limit = latency_limit(kind, ttft_slo_s, tbt_slo_s, alpha)
        if stage is Stage.ENCODE:
            n = profile.image_budget(limit, pixels)
            return n / profile.step_s(images=n, pixels=pixels)
        if stage is Stage.PREFILL:
            n = profile.token_budget(limit)
            return n / profile.step_s(prefill_tokens=n)
        kv_seqs = int(profile.kv_capacity_tokens // (w.prompt_tokens + visual + w.output_tokens))
        b = max(1, min(profile.max_num_seqs, kv_seqs, _decode_batch(profile, limit, ctx)))
        return b / profile.step_s(decodes=b, context=ctx)

    per_type = {}
    for kind in InstanceType:
        per_type[kind] = sum(work[s] / throughput(kind, s) for s in kind.stages if work[s] > 0)
    return StageCosts(per_type)


def _decode_batch(profile: StepProfile, limit: float, ctx: float, hi: int = 4096) -> int:
    """Largest decode batch whose step stays under the limit (Alg. 2 line 8)."""
    lo, best = 1, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if profile.step_s(decodes=mid, context=ctx) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def best_ratios(method: str, n: int, costs: StageCosts, keep: int = 3) -> list[dict[InstanceType, int]]:
    """The `keep` ratios of `method` over n instances with the highest bound: O(n) per method
    (for three types, the best P:D split of what E leaves follows from the bound)."""
    kinds = METHODS[method]
    if n < len(kinds):
        return []
    if len(kinds) == 1:
        return [{kinds[0]: n}]
    scored: list[tuple[float, dict[InstanceType, int]]] = []
    if len(kinds) == 2:
        for a in range(1, n):
            c = {kinds[0]: a, kinds[1]: n - a}
            scored.append((costs.bound(c), c))
    else:
        e, p, d = kinds
        wp, wd = costs.per_type[p], costs.per_type[d]
        for ne in range(1, n - 1):
            rest = n - ne
            ideal = rest * wp / (wp + wd) if wp + wd > 0 else rest / 2
            for np_ in {max(1, min(rest - 1, int(ideal) + k)) for k in (-1, 0, 1, 2)}:
                c = {e: ne, p: np_, d: rest - np_}
                scored.append((costs.bound(c), c))
    scored.sort(key=lambda x: -x[0])
    return [c for _, c in scored[:keep]]


def all_ratios(method: str, n: int) -> list[dict[InstanceType, int]]:
    """Every ratio of `method` over n instances (each type at least one)."""
    kinds = METHODS[method]
    if len(kinds) == 1:
        return [{kinds[0]: n}]
    if len(kinds) == 2:
        return [{kinds[0]: a, kinds[1]: n - a} for a in range(1, n)]
    return [{kinds[0]: a, kinds[1]: b, kinds[2]: n - a - b} for a in range(1, n - 1) for b in range(1, n - a)]
