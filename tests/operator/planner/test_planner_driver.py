"""The driver with a fake clock: decisions, replans on their own interval, the metrics and
the /plan document, dry run."""

from __future__ import annotations

import math

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from triptych.operator.planner.connectors import RecordingConnector, apply
from triptych.operator.planner.driver import Driver, DriverConfig, PlannerMetrics, Replan, method_of
from triptych.operator.planner.policy_types import PolicyConfig, Proposal
from triptych.operator.planner.replanner import window_spec
from triptych.operator.planner.signals import DecodeLoad, Snapshot, StageQueue
from triptych.topology import InstanceType as T

EPD = {T.E: 2, T.P: 2, T.D: 2}
CFG = PolicyConfig(sustain=2, role_switch_cooldown_s=100, max_queue_per_instance=10, encoder_scaling=False)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def snap(pre: float = 0, dec: float = 0, attainment: float | None = 0.8, rate: float | None = 2.0) -> Snapshot:
    return Snapshot(at=0, source="scrape", queues={
        "encode": StageQueue(instances=2), "prefill": StageQueue(requests=pre, tokens=pre * 100, instances=2),
        "decode": StageQueue(requests=dec, instances=2)}, slo_attainment=attainment, arrival_rate_rps=rate,
        images_per_request=1.0, prompt_tokens_per_request=50, output_tokens_per_request=20, ttft_p90_s=1.5)


def samples(metrics: PlannerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def run(driver: Driver, conn: RecordingConnector, snaps: list[Snapshot], clock: Clock, step: float = 15) -> list:
    out = []
    for s in snaps:
        d = driver.observe(s, conn.counts())
        apply(d, conn, conn.roles, conn.counts())
        driver.acted(d)
        out.append(d)
        clock.t += step
    return out


def test_a_deep_prefill_queue_moves_one_instance_after_sustain_and_the_cooldown_holds() -> None:
    clock = Clock()
    driver = Driver(CFG, clock=clock)
    conn = RecordingConnector({T.E: 2, T.P: 2, T.D: 3})
    ds = run(driver, conn, [snap(pre=18)] * 6, clock)
    assert [d.action for d in ds] == ["none", "switch_role", "none", "none", "none", "none"]
    assert [c.method for c in conn.calls] == ["switch_role"]
    assert (ds[1].from_type, ds[1].to_type) == (T.D, T.P) and conn.counts() == {T.E: 2, T.P: 3, T.D: 2}
    assert ds[1].at == 1015.0  # the driver's clock, not the snapshot's
    assert "cooldown" in ds[2].reason
    doc = driver.document()
    assert doc.counts == {"E": 2, "P": 3, "D": 2} and doc.method == "E+P+D" and doc.ratio == "2:3:2"
    assert doc.last_action == ds[1] and doc.decisions == 6 and doc.actions == 1
    assert doc.observed_attainment == 0.8 and doc.reason == ds[-1].reason


def test_metrics_count_decisions_by_action_and_rule_and_show_the_snapshot() -> None:
    clock = Clock()
    metrics = PlannerMetrics(deployment="demo")
    driver = Driver(CFG, metrics=metrics, clock=clock)
    run(driver, RecordingConnector(EPD), [snap(pre=18)] * 3, clock)
    got = samples(metrics)
    dep = ("deployment", "demo")
    assert got[("triptych_planner_decisions_total", (("action", "none"), dep, ("dry_run", "false"),
                                                     ("rule", "none")))] == 2
    assert got[("triptych_planner_decisions_total", (("action", "switch_role"), dep, ("dry_run", "false"),
                                                     ("rule", "reactive")))] == 1
    assert got[("triptych_planner_queued_requests", (dep, ("stage", "prefill")))] == 18
    assert got[("triptych_planner_queued_tokens", (dep, ("stage", "prefill")))] == 1800
    assert got[("triptych_planner_observed_attainment", (dep,))] == 0.8
    assert got[("triptych_planner_ttft_p90_seconds", (dep,))] == 1.5
    assert got[("triptych_planner_instances", (dep, ("type", "P")))] == 3  # after the switch was applied
    assert got[("triptych_planner_trigger", (dep, ("trigger", "diverged")))] == 1
    assert got[("triptych_planner_last_decision_timestamp_seconds", (dep,))] == 1030.0
    assert math.isnan(got[("triptych_planner_decode_seats_used", (dep,))])  # no seats exported: unknown


def test_metrics_show_decode_pressure_and_the_video_queue() -> None:
    metrics = PlannerMetrics(deployment="demo")
    driver = Driver(CFG, metrics=metrics, clock=Clock())
    s = snap().model_copy(update={"tpot_p90_s": 0.07, "video_queued_gop_sets": 5.0,
                                  "decode": DecodeLoad(running=6, seats=8, kv_used_blocks=30, kv_total_blocks=120)})
    driver.observe(s, EPD)
    got = samples(metrics)
    dep = (("deployment", "demo"),)
    assert got[("triptych_planner_tpot_p90_seconds", dep)] == 0.07
    assert got[("triptych_planner_decode_seats_used", dep)] == 0.75
    assert got[("triptych_planner_decode_kv_used", dep)] == 0.25
    assert got[("triptych_planner_video_queued_gop_sets", dep)] == 5.0


def test_dry_run_records_but_the_counts_stay() -> None:
    clock = Clock()
    driver = Driver(CFG.model_copy(update={"dry_run": True}), clock=clock)
    conn = RecordingConnector(EPD)
    ds = run(driver, conn, [snap(pre=18)] * 3, clock)
    assert [d.action for d in ds] == ["none", "switch_role", "none"]  # cooldown counts dry-run decisions too
    assert ds[1].dry_run and conn.calls == [] and len(conn.decisions) == 3
    assert driver.document().counts == {"E": 2, "P": 2, "D": 2} and driver.document().dry_run


def test_replans_run_on_their_own_interval_and_feed_the_policy() -> None:
    clock = Clock()
    calls = []

    def replanner(window, counts):  # type: ignore[no-untyped-def]
        calls.append((clock.t, len(window), dict(counts)))
        return Replan(proposal=Proposal(method="E+PD", counts={T.E: 2, T.PD: 4}, predicted_goodput_rps=10,
                                        current_goodput_rps=5), predicted_attainment=0.95)

    metrics = PlannerMetrics()
    cfg = CFG.model_copy(update={"role_switching": True, "divergence_on": 9.0})  # reactive off
    driver = Driver(cfg, DriverConfig(replan_interval_s=60), replanner, metrics, clock)
    conn = RecordingConnector({T.E: 3, T.PD: 3})
    ds = run(driver, conn, [snap()] * 6, clock)  # t = 1000 .. 1075
    assert [c[0] for c in calls] == [1000.0, 1060.0]
    assert calls[1][1] == 5  # the window holds the snapshots so far
    assert ds[0].rule == "replan" and ds[0].from_type == T.E and ds[0].to_type == T.PD
    assert conn.counts() == {T.E: 2, T.PD: 4}
    assert "already at the proposal" in ds[-1].reason
    doc = driver.document()
    assert doc.predicted_attainment == 0.95 and doc.proposal is not None and doc.replanned_at == 1060.0
    got = samples(metrics)
    assert got[("triptych_planner_predicted_goodput_rps", (("deployment", ""),))] == 10
    assert got[("triptych_planner_predicted_attainment", (("deployment", ""),))] == 0.95


def test_a_failed_action_is_reported_and_the_counts_stay() -> None:
    clock = Clock()
    metrics = PlannerMetrics()
    driver = Driver(CFG, metrics=metrics, clock=clock)
    driver.observe(snap(pre=18), EPD)
    d = driver.observe(snap(pre=18), EPD)
    assert d.action == "switch_role"
    driver.acted(d, "worker refused")
    doc = driver.document()
    assert doc.actuation_error == "worker refused" and doc.counts == {"E": 2, "P": 2, "D": 2}
    assert samples(metrics)[("triptych_planner_actuation_failures_total",
                             (("action", "switch_role"), ("deployment", "")))] == 1


def test_window_spec_is_the_mean_shape_and_none_without_traffic() -> None:
    assert window_spec([snap(rate=None), snap(rate=0.0)]) is None
    spec = window_spec([snap(rate=2.0), snap(rate=4.0), snap(rate=None)])
    assert spec is not None and spec.rate == 3.0
    assert spec.prompt_tokens.value == 50 and spec.output_tokens.value == 20 and spec.images_per_request.value == 1


def test_method_names_follow_the_capacity_module() -> None:
    assert method_of({T.E: 1, T.P: 1, T.D: 1}) == "E+P+D"
    assert method_of({T.EP: 2, T.D: 1}) == "EP+D"
    assert method_of({T.EPD: 3}) == "EPD"


def test_the_actuation_modules_import_no_torch_and_no_worker_code() -> None:
    import subprocess
    import sys

    mods = ("driver", "replanner", "endpoint", "local_connector", "local_main", "k8s_connector", "k8s_daemon")
    code = (f"import sys; [__import__('triptych.operator.planner.' + m) for m in {mods!r}]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('triptych.worker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_cooldowns_outlive_an_operator_restart_through_status_plan() -> None:
    from triptych.operator.planner.k8s_daemon import seed_history

    clock = Clock()
    first = Driver(CFG, clock=clock)
    first.observe(snap(pre=18), {T.E: 2, T.P: 2, T.D: 3})
    acted = first.observe(snap(pre=18), {T.E: 2, T.P: 2, T.D: 3})
    assert acted.action == "switch_role"
    status = {"plan": first.document().model_dump(mode="json", exclude={"snapshot"})}
    clock.t += 30
    second = Driver(CFG, clock=clock)  # a new operator process
    second.history = seed_history(status)
    d = [second.observe(snap(pre=18), {T.E: 2, T.P: 3, T.D: 2}) for _ in range(2)][-1]
    assert d.action == "none" and "role-switch cooldown: 70 s left" in d.reason
    assert seed_history(None).decisions == [] and seed_history({"plan": {"last_action": {"bad": 1}}}).decisions == []


def test_one_registry_serves_several_deployments_and_forgets_a_stopped_one() -> None:
    shared = PlannerMetrics()
    a, b = shared.view("ns/a"), shared.view("ns/b")
    clock = Clock()
    for metrics in (a, b):
        Driver(CFG, metrics=metrics, clock=clock).observe(snap(pre=3), EPD)
    deployments = {dict(k[1])["deployment"] for k in samples(shared) if k[0] == "triptych_planner_decisions_total"}
    assert deployments == {"ns/a", "ns/b"}
    a.forget()
    left = {dict(k[1]).get("deployment") for k in samples(shared)}
    assert "ns/a" not in left and "ns/b" in left


def test_the_window_replanner_proposes_a_plan_for_the_same_instance_count(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from planner_models import QWEN2_VL_7B, write_model

    from triptych.operator.planner.model_shape import read_shape
    from triptych.operator.planner.optimizer import PlanConfig
    from triptych.operator.planner.replanner import WindowReplanner
    from triptych.operator.planner.roofline import roofline_profile
    from triptych.operator.planner.simulator import SimConfig

    profile = roofline_profile(read_shape(write_model(tmp_path / "m", QWEN2_VL_7B)), "H100")
    replanner = WindowReplanner(profile, SimConfig(ttft_slo_s=1.0, tbt_slo_s=0.05),
                                PlanConfig(confirm_replicas=0, min_duration_s=5.0, keep_per_method=1), num_requests=100)
    assert replanner([snap(rate=None)], {T.E: 1, T.P: 1, T.D: 2}) is None  # no traffic seen: nothing to plan on
    result = replanner([snap(rate=4.0)] * 3, {T.E: 1, T.P: 1, T.D: 2})
    assert result is not None
    assert sum(result.proposal.counts.values()) == 4
    assert result.proposal.predicted_goodput_rps > 0 and result.proposal.current_goodput_rps > 0
    assert result.proposal.predicted_goodput_rps >= result.proposal.current_goodput_rps * 0.97  # the best of all
    assert result.predicted_attainment is not None and 0 <= result.predicted_attainment <= 1
