"""The autoscaling policy's inputs and outputs (policy.py holds the rules): PolicyConfig,
its thresholds (from the CRD's spec.autoscaling), Proposal, a replan result, Decision, one
decision with its reason and trigger states, and History, the past decisions the rules
read for sustain, hysteresis and cooldowns."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from triptych.operator.api import AutoscalingConfig
from triptych.topology import InstanceType

Action = Literal["none", "switch_role", "scale"]
Rule = Literal["reactive", "decode", "encoder", "video", "replan", "none"]


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
    # decode pressure (each signal's up / down level; a missing signal does not count)
    decode_scaling: bool = True
    slo_tbt_s: float | None = Field(None, gt=0, description="the TBT SLO the TBT p90 is measured against")
    decode_up: float = Field(1.0, gt=0, description="TBT p90 / SLO at which decode is under pressure")
    decode_down: float = Field(0.5, ge=0, description="TBT p90 / SLO under which a lent instance goes back")
    seats_up: float = Field(0.9, gt=0, description="running / max_num_seqs over decoding instances")
    seats_down: float = Field(0.5, ge=0)
    kv_up: float = Field(0.9, gt=0, description="KV blocks used / total over decoding instances")
    kv_down: float = Field(0.5, ge=0)
    # video-decode autoscaling: queued GOP sets per V instance
    video_scaling: bool = True
    video_up: float = Field(8.0, gt=0)
    video_down: float = Field(0.5, ge=0)
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
