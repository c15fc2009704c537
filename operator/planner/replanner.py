"""Replans from live signals: the recent workload window -> optimizer.plan -> a Proposal.

The window is the driver's recent snapshots; their mean arrival rate and request shape
(images, prompt and output tokens per request) become a synthetic Poisson trace
(workload.generate) - the shape the router's counters show, not the exact lengths - and the
optimizer ranks every method and ratio on it (TriInfer Alg. 2; EPDServe §3.2.3), then
`evaluate()` prices the current counts on the same trace so the policy can weigh the gain.

The router's prompt-token counter counts visual tokens too; the trace takes it as text
tokens, so visual work is counted twice on the prefill side (a safe-side overestimate).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from triptych.operator.planner.driver import Replan
from triptych.operator.planner.optimizer import PlanConfig, evaluate, plan
from triptych.operator.planner.policy_types import Proposal
from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.signals import Snapshot
from triptych.operator.planner.simulator import SimConfig
from triptych.operator.planner.workload import WorkloadSpec, fixed, generate
from triptych.topology import InstanceType

log = logging.getLogger(__name__)


def window_spec(snapshots: Sequence[Snapshot], num_requests: int = 300,
                image_size: tuple[int, int] = (448, 448)) -> WorkloadSpec | None:
    """The window's mean workload; None while no snapshot saw finished requests."""
    seen = [s for s in snapshots if s.arrival_rate_rps and s.arrival_rate_rps > 0]
    if not seen:
        return None

    def mean(field: str) -> float:
        vals = [getattr(s, field) for s in seen if getattr(s, field) is not None]
        return sum(vals) / len(vals) if vals else 0.0

    return WorkloadSpec(rate=mean("arrival_rate_rps"), num_requests=num_requests,
                        images_per_request=fixed(round(mean("images_per_request"))), image_size=image_size,
                        prompt_tokens=fixed(max(1, round(mean("prompt_tokens_per_request")))),
                        output_tokens=fixed(max(1, round(mean("output_tokens_per_request")))))


class WindowReplanner:
    """A driver `Replanner` over a StepProfile (measured or roofline)."""

    def __init__(self, profile: StepProfile, sim: SimConfig, cfg: PlanConfig | None = None,
                 num_requests: int = 300) -> None:
        self.profile = profile
        self.sim = sim
        # a live replan must finish well inside its interval: no confirmations, and runs of
        # at most 2000 arrivals (a small model on a large GPU passes thousands a second)
        self.cfg = cfg or PlanConfig(confirm_replicas=0, min_duration_s=10.0, max_requests=2000)
        self.num_requests = num_requests

    def __call__(self, snapshots: Sequence[Snapshot], counts: dict[InstanceType, int]) -> Replan | None:
        spec = window_spec(snapshots, self.num_requests)
        if spec is None or not counts:
            return None
        trace = generate(spec)
        try:
            result = plan(self.profile, trace, sum(counts.values()), self.sim, self.cfg)
            current = evaluate(self.profile, trace, counts, self.sim, self.cfg)
        except ValueError as e:
            log.warning("replan failed: %s", e)
            return None
        return Replan(proposal=Proposal.from_plan(result, current), predicted_attainment=result.predicted_attainment)
