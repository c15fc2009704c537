"""The planner's loop: signals -> decide() -> a connector, with memory and a report.

Every `interval_s` the caller hands the driver a `Snapshot` (signals.py) and the current
counts; `observe()` keeps the recent snapshots (the workload window a replan plans on) and
the decision history, asks the replanner for a `Proposal` on its own slower interval
(`replan_interval_s`, TriInfer §4.4 "Redeploy"), calls the pure `policy.decide()`, and
publishes the result as `triptych_planner_*` metrics and the `/plan` document. Acting on
the decision is the connector's (connectors.apply, or the Kubernetes connector's own
`act`); the driver only remembers whether that worked (`acted()`).

No I/O and no clock of its own beyond the injected `clock`: tests drive it with a fake one.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, Field

from triptych.operator.planner.policy import decide
from triptych.operator.planner.policy_types import Decision, History, PolicyConfig, Proposal
from triptych.operator.planner.signals import STAGES, Snapshot
from triptych.topology import InstanceType, format_topology

P = "triptych_planner"


class DriverConfig(BaseModel):
    interval_s: float = Field(15.0, gt=0, description="seconds between snapshots and decisions")
    replan_interval_s: float = Field(300.0, gt=0, description="seconds between replans (the CRD's "
                                     "replanIntervalSeconds)")
    history: int = Field(256, ge=1, description="decisions kept (the policy looks at the last few)")
    window: int = Field(40, ge=1, description="snapshots kept for the workload window of a replan")


class Replan(BaseModel):
    """What a replanner returns: the policy's Proposal plus what the optimizer predicts."""

    proposal: Proposal
    predicted_attainment: float | None = None
    at: float = 0.0


Replanner = Callable[[Sequence[Snapshot], dict[InstanceType, int]], Replan | None]


class PlanDocument(BaseModel):
    """The `/plan` JSON (locally) and `status.plan` (Kubernetes)."""

    method: str = Field(description="hybrid method of the current counts, e.g. E+P+D")
    topology: str
    counts: dict[str, int]
    ratio: str = Field(description="instances per type in E:P:D-style order, e.g. 1:2:3")
    dry_run: bool
    decisions: int = Field(description="decisions taken since the driver started")
    actions: int = Field(description="decisions that asked for an action")
    last_decision: Decision | None = None
    last_action: Decision | None = None
    reason: str = ""
    actuation_error: str | None = None
    predicted_attainment: float | None = None
    observed_attainment: float | None = None
    proposal: Proposal | None = None
    replanned_at: float | None = None
    snapshot: Snapshot | None = None


def method_of(counts: dict[InstanceType, int]) -> str:
    """The hybrid method a deployment runs, named as capacity.METHODS names them."""
    order = ("E", "EP", "ED", "EPD", "P", "PD", "D")
    return "+".join(k for k in order if counts.get(InstanceType(k), 0) > 0) or "none"


def _ratio(counts: dict[InstanceType, int]) -> str:
    order = ("E", "EP", "ED", "EPD", "P", "PD", "D")
    return ":".join(str(counts[InstanceType(k)]) for k in order if counts.get(InstanceType(k), 0) > 0)


class PlannerMetrics:
    """`triptych_planner_*` series on their own registry (one per planner process; the
    operator labels them by deployment)."""

    def __init__(self, registry: CollectorRegistry | None = None, deployment: str = "") -> None:
        self.registry = registry or CollectorRegistry()
        self.deployment = deployment
        d = ["deployment"]
        r = self.registry
        self.decisions = Counter(f"{P}_decisions", "Decisions by action and rule (the reason's kind)",
                                 d + ["action", "rule", "dry_run"], registry=r)
        self.failures = Counter(f"{P}_actuation_failures", "Actions the connector could not carry out",
                                d + ["action"], registry=r)
        self.predicted = Gauge(f"{P}_predicted_attainment", "SLO attainment the optimizer predicts", d, registry=r)
        self.observed = Gauge(f"{P}_observed_attainment", "SLO attainment the last snapshot shows", d, registry=r)
        self.predicted_goodput = Gauge(f"{P}_predicted_goodput_rps", "Goodput of the last proposal", d, registry=r)
        self.current_goodput = Gauge(f"{P}_current_goodput_rps", "Predicted goodput of the current plan",
                                     d, registry=r)
        self.instances = Gauge(f"{P}_instances", "Instances per type (the plan)", d + ["type"], registry=r)
        self.target = Gauge(f"{P}_target_instances", "Instances per type after the last decision",
                            d + ["type"], registry=r)
        self.queued_requests = Gauge(f"{P}_queued_requests", "Queued requests per stage (snapshot)",
                                     d + ["stage"], registry=r)
        self.queued_tokens = Gauge(f"{P}_queued_tokens", "Queued tokens per stage (snapshot)", d + ["stage"],
                                   registry=r)
        self.queued_images = Gauge(f"{P}_queued_images", "Queued images per stage (snapshot)", d + ["stage"],
                                   registry=r)
        self.stage_instances = Gauge(f"{P}_stage_instances", "Ready instances per stage (snapshot)",
                                     d + ["stage"], registry=r)
        self.ttft = Gauge(f"{P}_ttft_p90_seconds", "TTFT p90 (snapshot)", d, registry=r)
        self.tbt = Gauge(f"{P}_tbt_p90_seconds", "TBT p90 (snapshot)", d, registry=r)
        self.tpot = Gauge(f"{P}_tpot_p90_seconds", "TPOT p90 (snapshot)", d, registry=r)
        self.decode_seats = Gauge(f"{P}_decode_seats_used", "Running / max_num_seqs over decoding instances "
                                  "(snapshot)", d, registry=r)
        self.decode_kv = Gauge(f"{P}_decode_kv_used", "KV blocks used / total over decoding instances (snapshot)",
                               d, registry=r)
        self.video_gop_sets = Gauge(f"{P}_video_queued_gop_sets", "GOP sets queued for V instances (snapshot)",
                                    d, registry=r)
        self.rate = Gauge(f"{P}_arrival_rate_rps", "Finished requests per second (snapshot)", d, registry=r)
        self.trigger = Gauge(f"{P}_trigger", "Each rule's trigger state (1 set)", d + ["trigger"], registry=r)
        self.last = Gauge(f"{P}_last_decision_timestamp_seconds", "When the last decision was taken", d,
                          registry=r)
        self.dry_run = Gauge(f"{P}_dry_run", "1 when decisions are only recorded", d, registry=r)

    def view(self, deployment: str) -> PlannerMetrics:
        """The same series, labelled for another deployment (one registry per operator)."""
        other = copy.copy(self)
        other.deployment = deployment
        return other

    def forget(self) -> None:
        """Drop this deployment's series (its planner stopped)."""
        for metric in vars(self).values():
            if isinstance(metric, Counter | Gauge):
                # prometheus_client keeps children by label values; the deployment is the first
                for labels in [k for k in list(metric._metrics) if k and k[0] == self.deployment]:
                    metric.remove(*labels)

    def publish(self, snap: Snapshot, counts: dict[InstanceType, int], decision: Decision) -> None:
        dep = self.deployment
        self.decisions.labels(dep, decision.action, decision.rule, str(decision.dry_run).lower()).inc()
        self.dry_run.labels(dep).set(1 if decision.dry_run else 0)
        self.last.labels(dep).set(decision.at)
        for kind in InstanceType:
            self.instances.labels(dep, kind.value).set(counts.get(kind, 0))
            target = decision.target if decision.action != "none" else counts
            self.target.labels(dep, kind.value).set(target.get(kind, 0))
        for stage in STAGES:
            q = snap.queues.get(stage)
            if q is None:
                continue
            self.queued_requests.labels(dep, stage).set(q.requests)
            self.queued_tokens.labels(dep, stage).set(q.tokens)
            self.queued_images.labels(dep, stage).set(q.images)
            self.stage_instances.labels(dep, stage).set(q.instances)
        for gauge, value in ((self.ttft, snap.ttft_p90_s), (self.tbt, snap.tbt_p90_s),
                             (self.rate, snap.arrival_rate_rps), (self.observed, snap.slo_attainment),
                             (self.tpot, snap.tpot_p90_s), (self.decode_seats, snap.decode.occupancy),
                             (self.decode_kv, snap.decode.kv_use), (self.video_gop_sets, snap.video_queued_gop_sets)):
            gauge.labels(dep).set(float("nan") if value is None else value)
        for name, state in decision.triggers.items():
            self.trigger.labels(dep, name).set(1 if state else 0)

    def publish_replan(self, replan: Replan) -> None:
        dep = self.deployment
        self.predicted_goodput.labels(dep).set(replan.proposal.predicted_goodput_rps)
        self.current_goodput.labels(dep).set(replan.proposal.current_goodput_rps)
        if replan.predicted_attainment is not None:
            self.predicted.labels(dep).set(replan.predicted_attainment)


class Driver:
    def __init__(self, policy: PolicyConfig, cfg: DriverConfig | None = None, replanner: Replanner | None = None,
                 metrics: PlannerMetrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.cfg = cfg or DriverConfig()
        self.replanner = replanner
        self.metrics = metrics or PlannerMetrics()
        self.clock = clock
        self.history = History()
        self.snapshots: deque[Snapshot] = deque(maxlen=self.cfg.window)
        self.replan: Replan | None = None
        self.counts: dict[InstanceType, int] = {}
        self.decisions = 0
        self.actions = 0
        self.last_action: Decision | None = None
        self.actuation_error: str | None = None

    def replan_due(self) -> bool:
        if self.replanner is None:
            return False
        return self.replan is None or self.clock() - self.replan.at >= self.cfg.replan_interval_s

    def observe(self, snap: Snapshot, counts: dict[InstanceType, int]) -> Decision:
        """One decision on this snapshot (its `at` is taken from the clock, so cooldowns run
        on the driver's time)."""
        now = self.clock()
        snap = snap.model_copy(update={"at": now})
        self.snapshots.append(snap)
        self.counts = {k: v for k, v in counts.items() if v > 0}
        if self.replan_due():
            assert self.replanner is not None
            result = self.replanner(list(self.snapshots), dict(self.counts))
            # a failed or empty replan still waits a full interval before the next attempt
            self.replan = (result or Replan(proposal=_no_proposal(self.counts))).model_copy(update={"at": now})
            self.metrics.publish_replan(self.replan)
        proposal = self.replan.proposal if self.replan and self.replan.proposal.method != "none" else None
        decision = decide(snap, self.counts, self.history, self.policy, proposal)
        self.history.decisions.append(decision)
        del self.history.decisions[:-self.cfg.history]
        self.decisions += 1
        if decision.action != "none":
            self.actions += 1
            self.last_action = decision
            self.actuation_error = None
        self.metrics.publish(snap, self.counts, decision)
        return decision

    def acted(self, decision: Decision, error: str | None = None) -> None:
        """The connector's outcome for `decision` (None: done, or nothing to do)."""
        if error is not None:
            self.actuation_error = error
            self.metrics.failures.labels(self.metrics.deployment, decision.action).inc()
        elif decision.action != "none" and not decision.dry_run:
            self.counts = dict(decision.target)

    def document(self) -> PlanDocument:
        last = self.history.decisions[-1] if self.history.decisions else None
        snap = self.snapshots[-1] if self.snapshots else None
        return PlanDocument(
            method=method_of(self.counts), topology=format_topology(self.counts) if self.counts else "",
            counts={k.value: v for k, v in self.counts.items()}, ratio=_ratio(self.counts),
            dry_run=self.policy.dry_run, decisions=self.decisions, actions=self.actions, last_decision=last,
            last_action=self.last_action, reason=last.reason if last else "", actuation_error=self.actuation_error,
            predicted_attainment=self.replan.predicted_attainment if self.replan else None,
            observed_attainment=snap.slo_attainment if snap else None,
            proposal=self.replan.proposal if self.replan and self.replan.proposal.method != "none" else None,
            replanned_at=self.replan.at if self.replan else None, snapshot=snap)


def _no_proposal(counts: dict[InstanceType, int]) -> Proposal:
    return Proposal(method="none", counts=counts, predicted_goodput_rps=0.0, current_goodput_rps=0.0)
