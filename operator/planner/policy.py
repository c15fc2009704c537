"""The autoscaling policy: a pure function (snapshot, current plan, bounds, recent history,
config, replan proposal) -> Decision. No I/O, no clock: `now` comes in with the snapshot.

Five rules, tried in this order; at most one action per decision, and every decision
(an action or none) carries its reason:

1. reactive (EPDServe §3.2.4): when the stages' queues diverge, move one instance from the
   least to the most loaded instance type; not when every stage's queue is already at
   least half its maximum (then the deployment is short of capacity, not misbalanced);
2. decode pressure: a decode bottleneck queues nothing (a handed-over request is seated at
   D at once, EPDServe Table 6's shift to long outputs shows as slower tokens, not as a
   queue), so it is read from TBT p90 against the SLO, decode seats in use and KV-cache
   use; on sustained pressure one instance of the least loaded non-decoding type moves to
   D, and goes back once the pressure would stay low even with one decoder fewer;
3. encoder autoscaling: add an E instance on sustained encode queueing, remove one when
   encode queues stay short (within the E bounds);
4. video-decode autoscaling: the same for V instances on the GOP sets queued for them;
5. replan (TriInfer Alg. 2 via optimizer.plan on the recent workload, computed by the
   caller): move toward the proposal's method and ratio, one role switch at a time, only
   when its predicted goodput beats the current plan's by the gain threshold.

Against flapping: a trigger must hold over `sustain` consecutive snapshots, the release
band sits below the trigger (hysteresis), and each action has its cooldown (the CRD's
spec.autoscaling: scale-up, scale-down and role-switch cooldowns).
"""

from __future__ import annotations

from collections.abc import Sequence

from triptych.operator.planner.policy_types import Decision, History, PolicyConfig, Proposal, Rule
from triptych.operator.planner.signals import Snapshot, StageQueue
from triptych.topology import InstanceType, Stage, format_topology


# --- the policy ---------------------------------------------------------------------------
def decide(snap: Snapshot, counts: dict[InstanceType, int], history: History, cfg: PolicyConfig,
           proposal: Proposal | None = None) -> Decision:
    now = snap.at
    counts = {k: v for k, v in counts.items() if v > 0}
    stage_counts = {k: v for k, v in counts.items() if k.stages}  # V is its own pool (the video rule's)
    fills = _type_fills(snap, stage_counts, cfg)
    triggers = _triggers(snap, counts, fills, history, cfg)
    protect = _protected(triggers, stage_counts)
    direction = _direction(fills, stage_counts, cfg, protect) if triggers["diverged"] else None
    base = {"at": now, "dry_run": cfg.dry_run, "triggers": triggers, "direction": direction}
    reasons = []
    for rule in (_reactive, _decode, _encoder, _video, _replan):
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


def _protected(triggers: dict[str, bool], counts: dict[InstanceType, int]) -> frozenset[InstanceType]:
    """Types no rule may take an instance from: under decode pressure, the decoding types
    (their empty queues would make them look idle to the reactive rule)."""
    if triggers.get("decode_high"):
        return frozenset(k for k in counts if k.runs(Stage.DECODE))
    return frozenset()


def _direction(fills: dict[InstanceType, float], counts: dict[InstanceType, int] | None = None,
               cfg: PolicyConfig | None = None, protect: frozenset[InstanceType] = frozenset()) -> str | None:
    """Least -> most loaded type. The source is the least loaded type that can give an
    instance (above its minimum, and not the last to run one of its stages): with E and D
    both idle in a 2E1P1D, the move is E -> P, not a D -> P the bounds would refuse forever."""
    if len(fills) < 2:
        return None
    dst = max(fills, key=lambda k: (fills[k], k.value))
    givers = [k for k in fills if k != dst and k not in protect
              and (counts is None or cfg is None or _can_give(counts, k, dst, cfg))]
    src = min(givers or [k for k in fills if k != dst and k not in protect] or [k for k in fills if k != dst],
              key=lambda k: (fills[k], k.value))
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
    pressure = _decode_pressure(snap, cfg)
    high = any(v >= up for v, up, _ in pressure.values()) or (
        prev.get("decode_high", False) and any(v > down for v, _, down in pressure.values()))
    n_v = counts.get(InstanceType.V, 0)
    per_v = (snap.video_queued_gop_sets or 0.0) / n_v if n_v else 0.0
    return {"diverged": diverged, "encode_high": n_e > 0 and per_e >= cfg.encode_up,
            "encode_low": n_e > 0 and per_e <= cfg.encode_down,
            "decode_high": high, "decode_low": not high and _decode_light(snap, counts, pressure),
            "video_high": n_v > 0 and snap.video_queued_gop_sets is not None and per_v >= cfg.video_up,
            "video_low": n_v > 0 and snap.video_queued_gop_sets is not None and per_v <= cfg.video_down}


# --- decode pressure ------------------------------------------------------------------------
def _decode_pressure(snap: Snapshot, cfg: PolicyConfig) -> dict[str, tuple[float, float, float]]:
    """The known decode-pressure signals: name -> (value, up level, down level). TBT p90
    (TPOT p90 where no gap was observed) against the SLO, decode seats and KV in use."""
    out = {}
    tbt = snap.tbt_p90_s if snap.tbt_p90_s is not None else snap.tpot_p90_s
    if tbt is not None and cfg.slo_tbt_s:
        out["TBT p90/SLO"] = (tbt / cfg.slo_tbt_s, cfg.decode_up, cfg.decode_down)
    if snap.decode.occupancy is not None:
        out["decode seats used"] = (snap.decode.occupancy, cfg.seats_up, cfg.seats_down)
    if snap.decode.kv_use is not None:
        out["KV used"] = (snap.decode.kv_use, cfg.kv_up, cfg.kv_down)
    return out


def _decode_light(snap: Snapshot, counts: dict[InstanceType, int],
                  pressure: dict[str, tuple[float, float, float]]) -> bool:
    """Every known signal stays at or under its down level even with one decoding instance
    fewer (each scaled by n / (n - 1): the same work on fewer decoders), and nothing waits
    for decode. The projection is what keeps a give-back from re-creating the pressure
    (no flapping between lending and giving back)."""
    n = sum(v for k, v in counts.items() if k.runs(Stage.DECODE))
    if n < 2 or not pressure or snap.queues.get(Stage.DECODE.value, StageQueue()).requests > 0:
        return False
    return all(v * n / (n - 1) <= down for v, _, down in pressure.values())


def _pressure_text(pressure: dict[str, tuple[float, float, float]]) -> str:
    return ", ".join(f"{name} {v:.2f}" for name, (v, _, _) in pressure.items()) or "no decode signal"


def _lent_to_decode(history: History) -> list[InstanceType]:
    """The types the decode rule took instances from and has not given back yet (a stack)."""
    lent: list[InstanceType] = []
    for d in history.decisions:
        if d.rule != "decode" or d.action != "switch_role" or d.dry_run:
            continue
        if d.to_type is InstanceType.D and d.from_type is not None:
            lent.append(d.from_type)
        elif d.from_type is InstanceType.D and lent:
            lent.pop()
    return lent


def _encode_work(snap: Snapshot) -> float:
    """Queued images; a waiting encode request holds at least one even where only request
    counts are known."""
    q = snap.queues.get("encode", StageQueue())
    return max(q.images, q.requests)


def _cooldown_left(history: History, action_rule: str, cooldown: float, now: float,
                   delta_sign: int = 0, kind: InstanceType | None = None) -> float:
    """Time left of the cooldown since the last action of this kind (scaling: of this
    direction and, given `kind`, of this type: E and V scale on their own clocks)."""
    def match(d: Decision) -> bool:
        if d.action == "none":
            return False
        if action_rule == "switch":
            return d.action == "switch_role"
        return d.action == "scale" and (d.delta > 0) == (delta_sign > 0) and kind in (None, d.scale_type)
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
    stage_counts = {k: v for k, v in counts.items() if k.stages}
    stage_fill = {s: q.requests / q.instances / cfg.max_queue_per_instance
                  for s, q in snap.queues.items() if q.instances}
    if stage_fill and min(stage_fill.values()) >= cfg.all_busy_fill:
        return None, (f"reactive: every stage's queue is at least {cfg.all_busy_fill:.0%} of its maximum "
                      "(short of capacity, not misbalanced)")
    if not triggers["diverged"]:
        return None, "reactive: stage queues do not diverge"
    direction = _direction(fills, stage_counts, cfg, _protected(triggers, stage_counts))
    held = 1
    for d in reversed(history.decisions[-(cfg.sustain - 1):] if cfg.sustain > 1 else []):
        if d.direction != direction:
            break
        held += 1
    if held < cfg.sustain:  # the same move must be wanted for `sustain` snapshots in a row
        return None, f"reactive: divergence {direction} held {held}/{cfg.sustain} snapshots"
    src_name, dst_name = direction.split("->")  # type: ignore[union-attr]
    src, dst = InstanceType(src_name), InstanceType(dst_name)
    if src in _protected(triggers, stage_counts):
        return None, f"reactive: {src.value} -> {dst.value} wanted, but decode is under pressure"
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
    return _scale_on_queue("encoder", "encode", InstanceType.E, _encode_work(snap) / n_e, "queued images",
                           (cfg.encode_down, cfg.encode_up), snap, counts, triggers, history, cfg)


def _scale_on_queue(rule: str, trigger: str, kind: InstanceType, per: float, unit: str,
                    levels: tuple[float, float], snap: Snapshot, counts: dict[InstanceType, int],
                    triggers: dict[str, bool], history: History, cfg: PolicyConfig) -> tuple[Decision | None, str]:
    """Add or remove one `kind` instance on its sustained queue per instance (`per`, in
    `unit`; `trigger`_high/_low fired against `levels` = (down, up)), within its bounds and
    the scale cooldowns: the encoder rule (queued images per E) and the video rule (queued
    GOP sets per V)."""
    n, k = counts[kind], kind.value
    lo, hi = cfg.bounds(kind)
    down, up = levels
    for trig, delta in ((f"{trigger}_high", 1), (f"{trigger}_low", -1)):
        if not triggers[trig]:
            continue
        held = history.held(trig, cfg.sustain) + 1
        if held < cfg.sustain:
            return None, f"{rule}: {per:.1f} {unit} per {k} held {held}/{cfg.sustain} snapshots"
        if delta > 0 and n >= hi:
            return None, f"{rule}: {k} is at its maximum {hi}"
        if delta < 0 and n <= max(lo, 1):
            return None, f"{rule}: {k} is at its minimum {max(lo, 1)}"
        cooldown = cfg.scale_up_cooldown_s if delta > 0 else cfg.scale_down_cooldown_s
        left = _cooldown_left(history, "scale", cooldown, snap.at, delta, kind)
        if left > 0:
            return None, f"{rule}: scale-{'up' if delta > 0 else 'down'} cooldown: {left:.0f} s left"
        target = dict(counts)
        target[kind] = n + delta
        return Decision(at=0, action="scale", rule=rule, scale_type=kind, delta=delta,
                        target=target, reason=f"{rule}: {per:.1f} {unit} per {k} "
                        f"{'>=' if delta > 0 else '<='} {up if delta > 0 else down}"
                        f" for {cfg.sustain} snapshots; {'add' if delta > 0 else 'remove'} one {k}"), ""
    return None, f"{rule}: {per:.1f} {unit} per {k}, within [{down}, {up}]"


def _decode(snap, counts, fills, triggers, history, cfg, proposal):  # type: ignore[no-untyped-def]
    if not cfg.decode_scaling:
        return None, "decode: pressure scaling off"
    pressure = _decode_pressure(snap, cfg)
    text = _pressure_text(pressure)
    dst = InstanceType.D
    if not counts.get(dst):
        return None, f"decode: {text}; no D instances in this plan"
    if triggers["decode_high"]:
        held = history.held("decode_high", cfg.sustain) + 1
        if held < cfg.sustain:
            return None, f"decode: under pressure ({text}) held {held}/{cfg.sustain} snapshots"
        givers = [k for k in fills if not k.runs(Stage.DECODE) and _can_give(counts, k, dst, cfg)]
        if not givers:
            return None, f"decode: under pressure ({text}), but no type can give an instance"
        src = min(givers, key=lambda k: (fills[k], k.value))
        if fills[src] >= cfg.all_busy_fill:  # EPDServe §3.2.4's guard: short of capacity, not misbalanced
            return None, (f"decode: under pressure ({text}), but {src.value}'s queue is {fills[src]:.0%} full too "
                          "(short of capacity, not misbalanced)")
        blocked = _switch_blocked(counts, src, dst, history, cfg, snap.at)
        if blocked:
            return None, f"decode: {src.value} -> D wanted ({text}), but {blocked}"
        return _switch(counts, src, dst, "decode", f"decode: under pressure ({text}) for {cfg.sustain} snapshots "
                       f"while {src.value}'s queue fill is {fills[src]:.2f}; move one {src.value} to D"), ""
    if triggers["decode_low"]:
        lent = _lent_to_decode(history)
        if not lent:
            return None, f"decode: light ({text}); nothing lent to D to give back"
        held = history.held("decode_low", cfg.sustain) + 1
        if held < cfg.sustain:
            return None, f"decode: light ({text}) held {held}/{cfg.sustain} snapshots"
        back = lent[-1]
        blocked = _switch_blocked(counts, dst, back, history, cfg, snap.at)
        if blocked:
            return None, f"decode: D -> {back.value} (give back) wanted, but {blocked}"
        return _switch(counts, dst, back, "decode", f"decode: light ({text}) even with one D fewer, for "
                       f"{cfg.sustain} snapshots; give the D lent by {back.value} back"), ""
    return None, f"decode: {text}, no sustained pressure"


def _video(snap, counts, fills, triggers, history, cfg, proposal):  # type: ignore[no-untyped-def]
    """V (video decode) instances on the GOP sets queued for them, as _encoder scales E."""
    n_v = counts.get(InstanceType.V, 0)
    if not cfg.video_scaling:
        return None, "video: autoscaling off"
    if not n_v:
        return None, "video: no V instances in this plan"
    if snap.video_queued_gop_sets is None:
        return None, "video: the router exports no GOP-set queue"
    return _scale_on_queue("video", "video", InstanceType.V, snap.video_queued_gop_sets / n_v, "queued GOP sets",
                           (cfg.video_down, cfg.video_up), snap, counts, triggers, history, cfg)


def _replan(snap, counts, fills, triggers, history, cfg, proposal):  # type: ignore[no-untyped-def]
    if proposal is None:
        return None, "replan: no proposal"
    target = {k: v for k, v in proposal.counts.items() if v > 0 and k.stages}
    video = {k: v for k, v in counts.items() if not k.stages}  # V is its own pool, not the replan's
    counts = {k: v for k, v in counts.items() if k.stages}
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
    return _switch({**counts, **video}, src, dst, "replan",
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
