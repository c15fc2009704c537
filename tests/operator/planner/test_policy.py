"""The policy is a pure function: every rule, bound, cooldown, the hysteresis and dry run,
over synthetic snapshots."""

from __future__ import annotations

import pytest

from triptych.operator.api import AutoscalingConfig, InstanceLimits
from triptych.operator.planner.connectors import RecordingConnector, apply
from triptych.operator.planner.policy import decide
from triptych.operator.planner.policy_types import Decision, History, PolicyConfig, Proposal
from triptych.operator.planner.signals import DecodeLoad, Snapshot, StageQueue
from triptych.topology import InstanceType as T

EPD3 = {T.E: 2, T.P: 2, T.D: 2}


def snap(at: float, enc: float = 0, pre: float = 0, dec: float = 0, images: float = 0,
         counts: dict[T, int] = EPD3) -> Snapshot:
    serving = {s: sum(n for k, n in counts.items() if any(st.value == s for st in k.stages))
               for s in ("encode", "prefill", "decode")}
    return Snapshot(at=at, source="scrape", queues={
        "encode": StageQueue(requests=enc, images=images, instances=serving["encode"]),
        "prefill": StageQueue(requests=pre, instances=serving["prefill"]),
        "decode": StageQueue(requests=dec, instances=serving["decode"])},
        instances={k.value: n for k, n in counts.items()})


def run(snaps: list[Snapshot], counts: dict[T, int], cfg: PolicyConfig,
        proposal: Proposal | None = None, apply_actions: bool = True) -> tuple[list[Decision], dict[T, int]]:
    """Drive the policy like the daemon will: decide, record, and (unless dry run) apply."""
    history, out = History(), []
    conn = RecordingConnector(counts)
    for s in snaps:
        d = decide(s, conn.counts(), history, cfg, proposal)
        apply(d, conn, conn.roles, conn.counts()) if apply_actions else None
        history.decisions.append(d)
        out.append(d)
    return out, conn.counts()


def actions(ds: list[Decision]) -> list[Decision]:
    return [d for d in ds if d.action != "none"]


CFG = PolicyConfig(sustain=3, role_switch_cooldown_s=120, scale_up_cooldown_s=60, scale_down_cooldown_s=300,
                   max_queue_per_instance=10, encode_up=8, encode_down=1, encoder_scaling=False)
ENC = CFG.model_copy(update={"encoder_scaling": True, "divergence_on": 10.0})  # reactive off


# --- reactive (EPDServe §3.2.4) ----------------------------------------------------------
def test_reactive_moves_one_instance_from_least_to_most_loaded_after_sustain() -> None:
    ds, counts = run([snap(t, enc=0, pre=2, dec=14) for t in (0, 10, 20)], EPD3, CFG)
    assert [d.action for d in ds] == ["none", "none", "switch_role"]
    assert "held 1/3" in ds[0].reason and "held 2/3" in ds[1].reason
    d = ds[2]
    assert (d.rule, d.from_type, d.to_type) == ("reactive", T.E, T.D)
    assert d.target == {T.E: 1, T.P: 2, T.D: 3} == counts
    assert "move one E to D" in d.reason


def test_reactive_holds_when_every_stage_is_at_least_half_full() -> None:
    ds, counts = run([snap(t, enc=10, pre=12, dec=19) for t in range(0, 50, 10)], EPD3, CFG)
    assert not actions(ds) and counts == EPD3
    assert all("short of capacity, not misbalanced" in d.reason for d in ds)


def test_no_flapping_when_the_spread_oscillates_around_the_trigger() -> None:
    # spread of fills (queue per instance / 10): 0.55 and 0.45 alternate around divergence_on=0.5
    snaps = [snap(t * 10, enc=0, pre=0, dec=11 if t % 2 == 0 else 9) for t in range(40)]
    ds, counts = run(snaps, EPD3, CFG.model_copy(update={"divergence_off": 0.25}))
    acts = actions(ds)
    # hysteresis keeps the trigger set (0.45 > release 0.25), so it acts once the spread has
    # held 3 snapshots; after that the cooldown spaces moves 120 s apart, and the queue it
    # reacts to never changes here, so at most one move per cooldown
    assert len(acts) <= 400 / 120 + 1
    gaps = [b.at - a.at for a, b in zip(acts, acts[1:], strict=False)]
    assert all(g >= 120 for g in gaps)


def test_no_action_when_the_trigger_never_holds_long_enough() -> None:
    # over the trigger every third snapshot, under the release band otherwise
    snaps = [snap(t * 10, dec=12 if t % 3 == 0 else 2) for t in range(30)]
    ds, counts = run(snaps, EPD3, CFG)
    assert not actions(ds) and counts == EPD3


def test_role_switch_cooldown_spaces_moves() -> None:
    ds, _ = run([snap(t, dec=18) for t in range(0, 300, 10)], {T.E: 4, T.P: 2, T.D: 2}, CFG)
    acts = actions(ds)
    assert [d.at for d in acts] == [20, 140, 260]
    assert any("role-switch cooldown: 110 s left" in d.reason for d in ds)


def test_role_switching_disabled() -> None:
    ds, counts = run([snap(t, dec=18) for t in range(0, 60, 10)], EPD3,
                     CFG.model_copy(update={"role_switching": False}))
    assert not actions(ds) and counts == EPD3
    assert "role switching is disabled" in ds[-1].reason


def test_min_bound_of_the_source_blocks_the_move() -> None:
    cfg = CFG.model_copy(update={"limits": {T.E: (2, 4), T.P: (2, 4)}})
    ds, counts = run([snap(t, enc=0, pre=1, dec=18) for t in range(0, 40, 10)], EPD3, cfg)
    assert not actions(ds) and counts == EPD3
    assert "E is at its minimum 2" in ds[-1].reason


def test_a_source_that_cannot_give_passes_to_the_next_least_loaded() -> None:
    # E (idle) is at its minimum: the move comes from P, the next least loaded type.
    cfg = CFG.model_copy(update={"limits": {T.E: (2, 4)}})
    ds, counts = run([snap(t, enc=0, pre=1, dec=18) for t in range(0, 40, 10)], EPD3, cfg)
    assert [(d.from_type, d.to_type) for d in actions(ds)] == [(T.P, T.D)]
    assert counts == {T.E: 2, T.P: 1, T.D: 3}
    # 2E1P1D after a shift to text-only prompts: E and D idle, P queued. D is the only
    # decoder, so E gives (not a D -> P the bounds would refuse forever).
    two_e = {T.E: 2, T.P: 1, T.D: 1}
    ds, counts = run([snap(t, enc=0, pre=12, dec=0, counts=two_e) for t in range(0, 40, 10)], two_e, CFG)
    assert [(d.from_type, d.to_type) for d in actions(ds)] == [(T.E, T.P)]
    assert counts == {T.E: 1, T.P: 2, T.D: 1}


def test_max_bound_of_the_target_blocks_the_move() -> None:
    cfg = CFG.model_copy(update={"limits": {T.D: (1, 2)}})
    ds, counts = run([snap(t, enc=0, pre=1, dec=18) for t in range(0, 40, 10)], EPD3, cfg)
    assert not actions(ds) and counts == EPD3
    assert "D is at its maximum 2" in ds[-1].reason


def test_never_removes_the_last_instance_of_a_stage() -> None:
    counts = {T.E: 1, T.P: 1, T.D: 1}
    ds, after = run([snap(t, enc=0, pre=1, dec=9, counts=counts) for t in range(0, 40, 10)], counts, CFG)
    assert after == counts
    assert "no instance would run the encode stage" in ds[-1].reason


# --- encoder autoscaling -----------------------------------------------------------------
def test_encoder_scale_up_on_sustained_queueing_then_cooldown_and_max() -> None:
    cfg = ENC.model_copy(update={"limits": {T.E: (1, 4)}})
    ds, counts = run([snap(t, images=40, counts={T.E: 2, T.P: 2, T.D: 2}) for t in range(0, 400, 10)],
                     {T.E: 2, T.P: 2, T.D: 2}, cfg)
    acts = actions(ds)
    assert [(d.at, d.delta, d.target[T.E]) for d in acts] == [(20, 1, 3), (80, 1, 4)]
    assert any("scale-up cooldown" in d.reason for d in ds)
    assert "E is at its maximum 4" in ds[-1].reason
    assert counts[T.E] == 4


def test_encoder_scale_down_respects_min_and_its_own_cooldown() -> None:
    cfg = ENC.model_copy(update={"limits": {T.E: (2, 8)}})
    ds, counts = run([snap(t, images=0) for t in range(0, 1000, 10)], {T.E: 4, T.P: 2, T.D: 2}, cfg)
    acts = actions(ds)
    assert [(d.at, d.delta) for d in acts] == [(20, -1), (320, -1)]
    assert counts[T.E] == 2 and "E is at its minimum 2" in ds[-1].reason


def test_encoder_holds_inside_the_band() -> None:
    ds, counts = run([snap(t, images=8) for t in range(0, 100, 10)], {T.E: 2, T.P: 2, T.D: 2},
                     ENC)
    assert not actions(ds) and "within [1.0, 8.0]" in ds[-1].reason  # 4 per E


# --- replan (TriInfer Alg. 2) ------------------------------------------------------------
def test_replan_moves_one_switch_at_a_time_toward_the_proposal() -> None:
    prop = Proposal(method="EP+D", counts={T.EP: 5, T.D: 3}, predicted_goodput_rps=12.0, current_goodput_rps=8.0)
    ds, counts = run([snap(t) for t in range(0, 2000, 60)], {T.E: 2, T.P: 3, T.D: 3},
                     CFG.model_copy(update={"role_switch_cooldown_s": 120}), prop)
    acts = actions(ds)
    assert all(d.rule == "replan" and d.action == "switch_role" for d in acts)
    assert all(b.at - a.at >= 120 for a, b in zip(acts, acts[1:], strict=False))
    assert counts == {T.EP: 5, T.D: 3}
    assert len(acts) == 5  # 2 E + 3 P become EP
    assert "already at the proposal 5EP3D" in ds[-1].reason


def test_replan_below_the_gain_threshold_does_nothing() -> None:
    prop = Proposal(method="EP+D", counts={T.EP: 5, T.D: 3}, predicted_goodput_rps=10.5, current_goodput_rps=10.0)
    ds, counts = run([snap(t) for t in range(0, 600, 60)], {T.E: 2, T.P: 3, T.D: 3}, CFG, prop)
    assert not actions(ds) and counts == {T.E: 2, T.P: 3, T.D: 3}
    assert "1.05x" in ds[-1].reason and "under the 1.10x threshold" in ds[-1].reason


def test_replan_never_changes_the_instance_count() -> None:
    prop = Proposal(method="EPD", counts={T.EPD: 9}, predicted_goodput_rps=99, current_goodput_rps=1)
    ds, _ = run([snap(0)], EPD3, CFG, prop)
    assert not actions(ds) and "different instance count" in ds[0].reason


# --- dry run, reasons --------------------------------------------------------------------
def test_dry_run_records_every_decision_and_changes_nothing() -> None:
    cfg = CFG.model_copy(update={"dry_run": True})
    history, conn = History(), RecordingConnector(EPD3)
    for t in range(0, 300, 10):
        d = decide(snap(t, dec=18), conn.counts(), history, cfg)
        apply(d, conn, conn.roles, conn.counts())
        history.decisions.append(d)
    assert conn.calls == [] and conn.counts() == EPD3
    assert len(conn.decisions) == 30 and all(d.dry_run for d in conn.decisions)
    # the would-be actions are recorded and pace themselves by the same cooldown
    assert [d.at for d in conn.decisions if d.action == "switch_role"] == [20, 140, 260]


def test_applied_switch_calls_the_connector() -> None:
    history, conn = History(), RecordingConnector(EPD3)
    for t in (0, 10, 20):
        d = decide(snap(t, dec=18), conn.counts(), history, CFG)
        apply(d, conn, conn.roles, conn.counts())
        history.decisions.append(d)
    assert [(c.method, c.args) for c in conn.calls] == [("switch_role", ["e-1", "D"])]


@pytest.mark.parametrize("s", [snap(0), snap(0, enc=3, pre=3, dec=3), snap(0, images=100)])
def test_every_decision_has_a_reason(s: Snapshot) -> None:
    d = decide(s, EPD3, History(), CFG)
    assert d.reason and d.at == 0


def test_config_from_the_crd() -> None:
    auto = AutoscalingConfig(enabled=True, prometheus_url="http://prom:9090", limits={T.E: InstanceLimits(min=1, max=5)},
                             scale_up_cooldown_seconds=30, scale_down_cooldown_seconds=600,
                             role_switch_cooldown_seconds=90, role_switching=False)
    cfg = PolicyConfig.from_crd(auto, dry_run=True)
    assert (cfg.scale_up_cooldown_s, cfg.scale_down_cooldown_s, cfg.role_switch_cooldown_s) == (30, 600, 90)
    assert cfg.limits == {T.E: (1, 5)} and cfg.dry_run and not cfg.role_switching


def test_no_reversal_when_queues_oscillate_between_two_stages() -> None:
    # the bottleneck alternates P <-> D every snapshot: a flapping policy would move an
    # instance there and back; a move must be wanted in the same direction 3 times in a row
    snaps = [snap(t * 10, pre=18 if t % 2 else 0, dec=0 if t % 2 else 18) for t in range(60)]
    ds, counts = run(snaps, EPD3, CFG.model_copy(update={"divergence_off": 0.6}))
    assert not actions(ds) and counts == EPD3
    assert "held 1/3" in ds[-1].reason


def test_encoder_does_not_flap_around_its_threshold() -> None:
    snaps = [snap(t * 10, images=16.2 if t % 2 else 15.8) for t in range(60)]  # 8.1 / 7.9 per E
    ds, counts = run(snaps, {T.E: 2, T.P: 2, T.D: 2}, ENC)
    assert not actions(ds) and counts[T.E] == 2
    assert any("held 1/3" in d.reason for d in ds)


# --- decode pressure (EPDServe Table 6: outputs 50 -> 500 tokens) ---------------------------
# A decode bottleneck queues nothing (a handed-over request is seated at D at once): the
# decode queue stays 0 in every snapshot here, only TBT p90 / seats / KV show it.
DEC = CFG.model_copy(update={"slo_tbt_s": 0.1})


def dsnap(at: float, tbt: float | None = None, running: float = 0, seats: float = 0, kv_used: float = 0,
          kv_total: float = 0, pre: float = 0, counts: dict[T, int] = EPD3) -> Snapshot:
    s = snap(at, pre=pre, counts=counts)
    s.tbt_p90_s = tbt
    s.decode = DecodeLoad(running=running, seats=seats, kv_used_blocks=kv_used, kv_total_blocks=kv_total)
    return s


def test_decode_pressure_moves_the_least_loaded_non_decoder_to_d() -> None:
    ds, counts = run([dsnap(t, tbt=0.15, pre=4) for t in (0, 10, 20)], EPD3, DEC)
    assert [d.action for d in ds] == ["none", "none", "switch_role"]
    assert "held 1/3" in ds[0].reason and "TBT p90/SLO 1.50" in ds[0].reason
    d = ds[2]
    # E (fill 0) gives, not P (fill 4/2/10 = 0.2); the queues alone show no divergence at all
    assert (d.rule, d.from_type, d.to_type) == ("decode", T.E, T.D) and not d.triggers["diverged"]
    assert counts == {T.E: 1, T.P: 2, T.D: 3} and "move one E to D" in d.reason


@pytest.mark.parametrize("load", [dict(running=15, seats=16), dict(kv_used=95, kv_total=100)])
def test_seats_or_kv_alone_signal_pressure(load: dict) -> None:
    # no TBT SLO known: full decode batches or a full KV cache are enough
    ds, counts = run([dsnap(t, **load) for t in (0, 10, 20)], EPD3, CFG)
    assert [(d.rule, d.to_type) for d in actions(ds)] == [("decode", T.D)]


def test_decode_pressure_holds_when_the_giver_is_busy_too() -> None:
    # 1E (its minimum) 2P 2D: P's queue is 60% full, E cannot give: short of capacity
    counts = {T.E: 1, T.P: 2, T.D: 2}
    cfg = DEC.model_copy(update={"limits": {T.E: (1, 4)}})
    ds, after = run([dsnap(t, tbt=0.3, pre=12, counts=counts) for t in range(0, 60, 10)], counts, cfg)
    assert not actions(ds) and after == counts
    assert "P's queue is 60% full too" in ds[-1].reason


def test_reactive_never_takes_a_decoder_under_decode_pressure() -> None:
    # P queues (fill 0.6) and D looks idle (empty queue): without the decode signal the
    # reactive rule moves D -> P, which would deepen the real bottleneck
    counts = {T.E: 1, T.P: 2, T.D: 2}
    cfg = DEC.model_copy(update={"limits": {T.E: (1, 4)}})
    calm, _ = run([dsnap(t, tbt=0.03, pre=12, counts=counts) for t in range(0, 40, 10)], counts, cfg)
    assert [(d.rule, d.from_type, d.to_type) for d in actions(calm)] == [("reactive", T.D, T.P)]
    busy, after = run([dsnap(t, tbt=0.3, pre=12, counts=counts) for t in range(0, 40, 10)], counts, cfg)
    assert not actions(busy) and after == counts
    assert "reactive: E -> P wanted, but E is at its minimum 1" in busy[-1].reason  # D is not offered
    assert "P's queue is 60% full too" in busy[-1].reason


def test_decode_max_bound_and_cooldown() -> None:
    cfg = DEC.model_copy(update={"limits": {T.D: (1, 3)}})
    ds, counts = run([dsnap(t, tbt=0.2) for t in range(0, 400, 10)], {T.E: 2, T.P: 3, T.D: 2}, cfg)
    assert [(d.at, d.from_type, d.to_type) for d in actions(ds)] == [(20, T.E, T.D)]
    assert "D is at its maximum 3" in ds[-1].reason and counts[T.D] == 3
    ds, counts = run([dsnap(t, tbt=0.2) for t in range(0, 300, 10)], {T.E: 4, T.P: 3, T.D: 2}, DEC)
    assert [d.at for d in actions(ds)] == [20, 140, 260]
    assert any("role-switch cooldown: 110 s left" in d.reason for d in ds)


def test_lent_decoder_goes_back_once_pressure_would_stay_low_with_one_fewer() -> None:
    hot = [dsnap(t, tbt=0.2) for t in range(0, 30, 10)]  # lends E -> D at t=20
    # 3 D at TBT 0.04 s: one fewer -> 0.06 s, over the 0.05 s release level: stays
    warm = [dsnap(t, tbt=0.04) for t in range(30, 400, 10)]
    # 3 D at 0.03 s: one fewer -> 0.045 s, under it: gives the E back
    cool = [dsnap(t, tbt=0.03) for t in range(400, 440, 10)]
    ds, counts = run(hot + warm + cool, EPD3, DEC)
    acts = actions(ds)
    assert [(d.at, d.from_type, d.to_type) for d in acts] == [(20, T.E, T.D), (420, T.D, T.E)]
    assert counts == EPD3 and "give the D lent by E back" in acts[1].reason
    assert all(d.action == "none" for d in ds[3:42])


def test_a_d_not_lent_by_the_decode_rule_stays() -> None:
    ds, counts = run([dsnap(t, tbt=0.01) for t in range(0, 100, 10)], EPD3, DEC)
    assert not actions(ds) and "nothing lent to D to give back" in ds[-1].reason


def test_decode_pressure_oscillating_around_the_threshold_moves_once_per_cooldown() -> None:
    # TBT p90 / SLO alternates 1.05 / 0.95 around decode_up = 1: hysteresis keeps the
    # trigger set (0.95 > decode_down 0.5), so one move after 3 snapshots, then the
    # cooldown paces further ones, and never a give-back
    snaps = [dsnap(t * 10, tbt=0.105 if t % 2 == 0 else 0.095) for t in range(40)]
    ds, counts = run(snaps, {T.E: 3, T.P: 3, T.D: 2}, DEC)
    acts = actions(ds)
    assert acts and all(d.to_type is T.D for d in acts)
    assert all(b.at - a.at >= 120 for a, b in zip(acts, acts[1:], strict=False))


def test_decode_pressure_flipping_between_high_and_light_never_acts() -> None:
    # high (1.2x the SLO) and light (0.3x, one fewer of 3 D -> 0.45x) alternate: neither
    # holds 3 snapshots in a row, so no lend and no give-back
    hot = [dsnap(t, tbt=0.2) for t in range(0, 30, 10)]
    flip = [dsnap(t * 10, tbt=0.12 if t % 2 else 0.03) for t in range(3, 60)]
    ds, counts = run(hot + flip, EPD3, DEC)
    assert [(d.from_type, d.to_type) for d in actions(ds)] == [(T.E, T.D)]
    assert counts == {T.E: 1, T.P: 2, T.D: 3}


def test_decode_scaling_off() -> None:
    ds, counts = run([dsnap(t, tbt=0.5) for t in range(0, 60, 10)], EPD3,
                     DEC.model_copy(update={"decode_scaling": False}))
    assert not actions(ds) and "decode: pressure scaling off" in ds[-1].reason


# --- video-decode (V) autoscaling ----------------------------------------------------------------
VID = CFG.model_copy(update={"video_up": 8, "video_down": 1})
WITH_V = {T.E: 2, T.P: 2, T.D: 2, T.V: 2}


def vsnap(at: float, gop_sets: float | None) -> Snapshot:
    s = snap(at)
    s.video_queued_gop_sets = gop_sets
    return s


def test_video_scale_up_on_sustained_gop_queueing_then_cooldown_and_max() -> None:
    cfg = VID.model_copy(update={"limits": {T.V: (1, 4)}})
    ds, counts = run([vsnap(t, 40) for t in range(0, 400, 10)], WITH_V, cfg)
    assert [(d.at, d.rule, d.scale_type, d.delta) for d in actions(ds)] == [(20, "video", T.V, 1),
                                                                          (80, "video", T.V, 1)]
    assert any("video: scale-up cooldown" in d.reason for d in ds)
    assert "V is at its maximum 4" in ds[-1].reason and counts[T.V] == 4
    assert {k: counts[k] for k in (T.E, T.P, T.D)} == {T.E: 2, T.P: 2, T.D: 2}


def test_video_scale_down_respects_min_and_cooldown() -> None:
    cfg = VID.model_copy(update={"limits": {T.V: (2, 8)}})
    ds, counts = run([vsnap(t, 0) for t in range(0, 1000, 10)], {**WITH_V, T.V: 4}, cfg)
    assert [(d.at, d.delta) for d in actions(ds)] == [(20, -1), (320, -1)]
    assert counts[T.V] == 2 and "V is at its minimum 2" in ds[-1].reason


def test_video_does_not_flap_and_needs_the_router_gauge() -> None:
    ds, counts = run([vsnap(t * 10, 16.2 if t % 2 else 15.8) for t in range(60)], WITH_V, VID)
    assert not actions(ds) and counts == WITH_V
    d = decide(vsnap(0, None), WITH_V, History(), VID)
    assert "the router exports no GOP-set queue" in d.reason


def test_v_is_never_a_role_switch_source_and_not_the_replans() -> None:
    # D queues, V is "idle" (it has no stage queue): the move comes from E, never from V
    ds, counts = run([snap(t, dec=18) for t in (0, 10, 20)], WITH_V, CFG)
    assert [(d.from_type, d.to_type) for d in actions(ds)] == [(T.E, T.D)]
    assert counts[T.V] == 2 and actions(ds)[0].target[T.V] == 2
    prop = Proposal(method="EP+D", counts={T.EP: 4, T.D: 2}, predicted_goodput_rps=12, current_goodput_rps=8)
    ds, counts = run([snap(t) for t in range(0, 600, 60)], WITH_V, CFG, prop)
    assert counts == {T.EP: 4, T.D: 2, T.V: 2}
