"""The autoscaling policy: a pure function (snapshot, current plan, bounds, recent history,
config, replan proposal) -> Decision. No I/O, no clock: `now` comes in with the snapshot.

Three rules, tried in this order; at most one action per decision, and every decision
(an action or none) carries its reason:

1. reactive (EPDServe §3.2.4): when the stages' queues diverge, move one instance from the
   least to the most loaded instance type; not when every stage's queue is already at
   least half its maximum (then the deployment is short of capacity, not misbalanced);
2. encoder autoscaling: add an E instance on sustained encode queueing, remove one when
   encode queues stay short (within the E bounds);
3. replan (TriInfer Alg. 2 via optimizer.plan on the recent workload, computed by the
   caller): move toward the proposal's method and ratio, one role switch at a time, only
   when its predicted goodput beats the current plan's by the gain threshold.

Against flapping: a trigger must hold over `sustain` consecutive snapshots, the release
band sits below the trigger (hysteresis), and each action has its cooldown (the CRD's
spec.autoscaling: scale-up, scale-down and role-switch cooldowns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from triptych.operator.api import AutoscalingConfig
from triptych.operator.planner.signals import Snapshot, StageQueue
from triptych.topology import InstanceType, format_topology

Action = Literal["none", "switch_role", "scale"]
Rule = Literal["reactive", "encoder", "replan", "none"]


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dry_run: bool = False
    role_switching: bool = True
    scale_up_cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0
    role_switch_cooldown_s: float = 120.0
    limits: dict[InstanceType, tuple[int, int]] = Field(default_factory=dict, description="(min, max) per type")
    sustain: int = Field(3, ge=1, description="consecutive snapshots a trigger must hold")
    # reactive: queue fill = queued requests per instance / max_queue_per_instance
    max_queue_per_instance: float = Field(16.0, gt=0)
    divergence_on: float = Field(0.5, gt=0, description="fill spread that triggers a move")
    divergence_off: float = Field(0.25, ge=0, description="fill spread under which a trigger resets")
    all_busy_fill: float = Field(0.5, description="EPDServe: no move when every stage is this full")
    # encoder autoscaling: queued images per E instance
    encoder_scaling: bool = True
    encode_up: float = Field(8.0, gt=0)
    encode_down: float = Field(1.0, ge=0)
    # replan
    replan_gain: float = Field(1.1, ge=1.0, description="proposal goodput / current goodput needed to move")

    @classmethod
    def from_crd(cls, auto: AutoscalingConfig, dry_run: bool = False, **overrides: object) -> PolicyConfig:
        """The CRD's spec.autoscaling; the thresholds it has no field for keep their defaults."""
        return cls(dry_run=dry_run, role_switching=auto.role_switching,
                   scale_up_cooldown_s=auto.scale_up_cooldown_seconds,
                   scale_down_cooldown_s=auto.scale_down_cooldown_seconds,
                   role_switch_cooldown_s=auto.role_switch_cooldown_seconds,
                   limits={k: (v.min, v.max) for k, v in auto.limits.items()}, **overrides)  # type: ignore[arg-type]

    def bounds(self, kind: InstanceType) -> tuple[int, int]:
        return self.limits.get(kind, (0, 1 << 30))


class Proposal(BaseModel):
    """A replan result, as the policy needs it (optimizer.PlanResult plus the current plan's
    goodput on the same workload)."""

    method: str
    counts: dict[InstanceType, int]
    predicted_goodput_rps: float
    current_goodput_rps: float

    @classmethod
    def from_plan(cls, result, current_goodput_rps: float) -> Proposal:  # type: ignore[no-untyped-def]
        """From optimizer.PlanResult and optimizer.evaluate() of the current counts."""
        return cls(method=result.method, counts={InstanceType(k): v for k, v in result.counts.items()},
                   predicted_goodput_rps=result.predicted_goodput_rps, current_goodput_rps=current_goodput_rps)


class Decision(BaseModel):
    at: float
    action: Action = "none"
    rule: Rule = "none"
    reason: str
    from_type: InstanceType | None = None  # switch_role: one instance of this type ...
    to_type: InstanceType | None = None  # ... becomes this type
    scale_type: InstanceType | None = None  # scale: this type ...
    delta: int = 0  # ... by this many
    target: dict[InstanceType, int] = Field(default_factory=dict, description="counts after the action")
    dry_run: bool = False
    triggers: dict[str, bool] = Field(default_factory=dict, description="each rule's trigger state")
    direction: str | None = Field(None, description="reactive: the move the queues point to, e.g. 'E->D'")


class History(BaseModel):
    """What the policy remembers: past decisions and trigger states (newest last)."""

    decisions: list[Decision] = Field(default_factory=list)

    def last(self, pred) -> Decision | None:  # type: ignore[no-untyped-def]
        for d in reversed(self.decisions):
            if pred(d):
                return d
        return None

    def held(self, trigger: str, n: int) -> int:
        """For how many of the last n-1 decisions in a row `trigger` was set (the current
        one makes n)."""
        count = 0
        for d in reversed(self.decisions[-(n - 1):] if n > 1 else []):
            if not d.triggers.get(trigger):
                break
            count += 1
        return count


# --- the policy ---------------------------------------------------------------------------
def decide(snap: Snapshot, counts: dict[InstanceType, int], history: History, cfg: PolicyConfig,
           proposal: Proposal | None = None) -> Decision:
    now = snap.at
    counts = {k: v for k, v in counts.items() if v > 0}
    fills = _type_fills(snap, counts, cfg)
    triggers = _triggers(snap, counts, fills, history, cfg)
    direction = _direction(fills, counts, cfg) if triggers["diverged"] else None
    base = {"at": now, "dry_run": cfg.dry_run, "triggers": triggers, "direction": direction}
    reasons = []
    for rule in (_reactive, _encoder, _replan):
        d, why = rule(snap, counts, fills, triggers, history, cfg, proposal)
        if d is not None:
            return d.model_copy(update=base)
        reasons.append(why)
    return Decision(reason="; ".join(reasons), **base)


def _type_fills(snap: Snapshot, counts: dict[InstanceType, int], cfg: PolicyConfig) -> dict[InstanceType, float]:
    """Each type's queue fill: the mean over its stages of queued requests per instance
    that serves the stage, relative to the maximum queue."""
    fills = {}
    for kind in counts:
        vals = []
        for stage in kind.stages:
            q = snap.queues.get(stage.value)
            serving = sum(n for k, n in counts.items() if k.runs(stage))
            if q is not None and serving:
                vals.append(q.requests / serving / cfg.max_queue_per_instance)
        fills[kind] = sum(vals) / len(vals) if vals else 0.0
    return fills


def _direction(fills: dict[InstanceType, float], counts: dict[InstanceType, int] | None = None,
               cfg: PolicyConfig | None = None) -> str | None:
    """Least -> most loaded type. The source is the least loaded type that can give an
    instance (above its minimum, and not the last to run one of its stages): with E and D
    both idle in a 2E1P1D, the move is E -> P, not a D -> P the bounds would refuse forever."""
    if len(fills) < 2:
        return None
    dst = max(fills, key=lambda k: (fills[k], k.value))
    givers = [k for k in fills if k != dst and (counts is None or cfg is None or _can_give(counts, k, dst, cfg))]
    src = min(givers or [k for k in fills if k != dst], key=lambda k: (fills[k], k.value))
    return f"{src.value}->{dst.value}"


def _can_give(counts: dict[InstanceType, int], src: InstanceType, dst: InstanceType, cfg: PolicyConfig) -> bool:
    if counts.get(src, 0) - 1 < cfg.bounds(src)[0]:
        return False
    after = dict(counts)
    after[src] -= 1
    after[dst] = after.get(dst, 0) + 1
    return all(any(k.runs(s) for k, n in after.items() if n > 0) for s in src.stages)


def _triggers(snap: Snapshot, counts: dict[InstanceType, int], fills: dict[InstanceType, float],
              history: History, cfg: PolicyConfig) -> dict[str, bool]:
    """Raw trigger states with hysteresis: a trigger set last time stays set until its
    value falls under the release band."""
    prev = history.decisions[-1].triggers if history.decisions else {}
    spread = max(fills.values()) - min(fills.values()) if len(fills) > 1 else 0.0
    diverged = spread >= cfg.divergence_on or (prev.get("diverged", False) and spread > cfg.divergence_off)
    n_e = counts.get(InstanceType.E, 0)
    per_e = _encode_work(snap) / n_e if n_e else 0.0
    return {"diverged": diverged, "encode_high": n_e > 0 and per_e >= cfg.encode_up,
            "encode_low": n_e > 0 and per_e <= cfg.encode_down}


def _encode_work(snap: Snapshot) -> float:
    """Queued images; a waiting encode request holds at least one even where only request
    counts are known."""
    q = snap.queues.get("encode", StageQueue())
    return max(q.images, q.requests)


def _cooldown_left(history: History, action_rule: str, cooldown: float, now: float,
                   delta_sign: int = 0) -> float:
    def match(d: Decision) -> bool:
        if d.action == "none":
            return False
        if action_rule == "switch":
            return d.action == "switch_role"
        return d.action == "scale" and (d.delta > 0) == (delta_sign > 0)
    last = history.last(match)
    return 0.0 if last is None else max(0.0, cooldown - (now - last.at))


def _switch(counts: dict[InstanceType, int], src: InstanceType, dst: InstanceType, rule: Rule,
            reason: str) -> Decision:
    target = dict(counts)
    target[src] -= 1
    target[dst] = target.get(dst, 0) + 1
    return Decision(at=0, action="switch_role", rule=rule, from_type=src, to_type=dst,
                    target={k: v for k, v in target.items() if v > 0}, reason=reason)


def _switch_blocked(counts: dict[InstanceType, int], src: InstanceType, dst: InstanceType,
                    history: History, cfg: PolicyConfig, now: float) -> str | None:
    if not cfg.role_switching:
        return "role switching is disabled"
    if counts.get(src, 0) - 1 < cfg.bounds(src)[0]:
        return f"{src.value} is at its minimum {cfg.bounds(src)[0]}"
    after = dict(counts)
    after[src] -= 1
    after[dst] = after.get(dst, 0) + 1
    lost = [s.value for s in src.stages if not any(k.runs(s) for k, n in after.items() if n > 0)]
    if lost:
        return f"no instance would run the {', '.join(lost)} stage"
    if counts.get(dst, 0) + 1 > cfg.bounds(dst)[1]:
        return f"{dst.value} is at its maximum {cfg.bounds(dst)[1]}"
    left = _cooldown_left(history, "switch", cfg.role_switch_cooldown_s, now)
    if left > 0:
        return f"role-switch cooldown: {left:.0f} s left"
    return None


def _reactive(snap, counts, fills, triggers, history, cfg, proposal):  # type: ignore[no-untyped-def]
    if len(fills) < 2:
        return None, "reactive: one instance type, nothing to move between"
    stage_fill = {s: q.requests / q.instances / cfg.max_queue_per_instance
                  for s, q in snap.queues.items() if q.instances}
    if stage_fill and min(stage_fill.values()) >= cfg.all_busy_fill:
        return None, (f"reactive: every stage's queue is at least {cfg.all_busy_fill:.0%} of its maximum "
                      "(short of capacity, not misbalanced)")
    if not triggers["diverged"]:
        return None, "reactive: stage queues do not diverge"
    direction = _direction(fills, counts, cfg)
    held = 1
    for d in reversed(history.decisions[-(cfg.sustain - 1):] if cfg.sustain > 1 else []):
        if d.direction != direction:
            break
        held += 1
    if held < cfg.sustain:  # the same move must be wanted for `sustain` snapshots in a row
        return None, f"reactive: divergence {direction} held {held}/{cfg.sustain} snapshots"
    src_name, dst_name = direction.split("->")  # type: ignore[union-attr]
    src, dst = InstanceType(src_name), InstanceType(dst_name)
    blocked = _switch_blocked(counts, src, dst, history, cfg, snap.at)
    if blocked:
        return None, f"reactive: {src.value} -> {dst.value} wanted, but {blocked}"
    return _switch(counts, src, dst, "reactive",
                   f"reactive: queue fill {dst.value} {fills[dst]:.2f} vs {src.value} {fills[src]:.2f}; "
                   f"move one {src.value} to {dst.value}"), ""


def _encoder(snap, counts, fills, triggers, history, cfg, proposal):  # type: ignore[no-untyped-def]
    n_e = counts.get(InstanceType.E, 0)
    if not cfg.encoder_scaling:
        return None, "encoder: autoscaling off"
    if not n_e:
        return None, "encoder: no E instances in this plan"
    lo, hi = cfg.bounds(InstanceType.E)
    per_e = _encode_work(snap) / n_e
    for trig, delta in (("encode_high", 1), ("encode_low", -1)):
        if not triggers[trig]:
            continue
        held = history.held(trig, cfg.sustain) + 1
        if held < cfg.sustain:
            return None, f"encoder: {per_e:.1f} queued images per E held {held}/{cfg.sustain} snapshots"
        if delta > 0 and n_e >= hi:
            return None, f"encoder: E is at its maximum {hi}"
        if delta < 0 and n_e <= max(lo, 1):
            return None, f"encoder: E is at its minimum {max(lo, 1)}"
        cooldown = cfg.scale_up_cooldown_s if delta > 0 else cfg.scale_down_cooldown_s
        left = _cooldown_left(history, "scale", cooldown, snap.at, delta)
        if left > 0:
            return None, f"encoder: scale-{'up' if delta > 0 else 'down'} cooldown: {left:.0f} s left"
        target = dict(counts)
        target[InstanceType.E] = n_e + delta
        return Decision(at=0, action="scale", rule="encoder", scale_type=InstanceType.E, delta=delta,
                        target=target, reason=f"encoder: {per_e:.1f} queued images per E "
                        f"{'>=' if delta > 0 else '<='} {cfg.encode_up if delta > 0 else cfg.encode_down}"
                        f" for {cfg.sustain} snapshots; {'add' if delta > 0 else 'remove'} one E"), ""
    return None, f"encoder: {per_e:.1f} queued images per E, within [{cfg.encode_down}, {cfg.encode_up}]"


def _replan(snap, counts, fills, triggers, history, cfg, proposal):  # type: ignore[no-untyped-def]
    if proposal is None:
        return None, "replan: no proposal"
    target = {k: v for k, v in proposal.counts.items() if v > 0}
    if target == counts:
        return None, f"replan: already at the proposal {format_topology(target)}"
    if sum(target.values()) != sum(counts.values()):
        return None, "replan: the proposal has a different instance count (scaling is not the replan's)"
    gain = proposal.predicted_goodput_rps / proposal.current_goodput_rps if proposal.current_goodput_rps > 0 \
        else float("inf")
    if gain < cfg.replan_gain:
        return None, (f"replan: {format_topology(target)} predicts {gain:.2f}x the goodput of "
                      f"{format_topology(counts)}, under the {cfg.replan_gain:.2f}x threshold")
    src, dst = _next_switch(counts, target)
    blocked = _switch_blocked(counts, src, dst, history, cfg, snap.at)
    if blocked:
        return None, f"replan: {src.value} -> {dst.value} toward {format_topology(target)} wanted, but {blocked}"
    return _switch(counts, src, dst, "replan",
                   f"replan: toward {proposal.method} {format_topology(target)} "
                   f"({proposal.predicted_goodput_rps:.2f} vs {proposal.current_goodput_rps:.2f} req/s predicted, "
                   f"{gain:.2f}x); move one {src.value} to {dst.value}"), ""


def _next_switch(counts: dict[InstanceType, int], target: dict[InstanceType, int]) -> tuple[InstanceType, InstanceType]:
    """The type with the largest surplus gives one instance to the one with the largest deficit."""
    kinds: Sequence[InstanceType] = sorted(set(counts) | set(target), key=lambda k: k.value)
    surplus = {k: counts.get(k, 0) - target.get(k, 0) for k in kinds}
    src = max(kinds, key=lambda k: surplus[k])
    dst = min(kinds, key=lambda k: surplus[k])
    return src, dst
