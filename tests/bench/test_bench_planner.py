"""`triptych bench simulate-validate` and `bench autoscale-shift`: their pure parts, and a
tiny smoke run of each against local deployments."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from triptych.bench.autoscale_shift import format_report, planner_args, shift_trace
from triptych.bench.sim_calibration import request_cpu_s
from triptych.bench.sim_validate import (
    Calibration,
    error_pct,
    fit_overheads,
    format_table,
    measure_profile,
    measured_cells,
    pooled,
    with_template,
)
from triptych.cli import build_parser, main
from triptych.operator.planner.model_shape import read_shape
from triptych.operator.planner.roofline import roofline_profile
from triptych.operator.planner.simulator import SimConfig, Simulation, simulate
from triptych.operator.planner.workload import TraceRequest
from triptych.tiny_model import tiny_model_path
from triptych.topology import parse_topology
from triptych.worker.engine.config import DEFAULT_IMAGE_BUDGET, DEFAULT_TOKEN_BUDGET


def shift_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "autoscale-shift", *extra])


def test_shift_trace_is_two_phases_of_the_given_shapes_in_order() -> None:
    args = shift_args("--rate", "2", "--phase-seconds", "5", "--before-images", "3", "--after-prompt", "500",
                      "--after-output", "9")
    trace, n_before = shift_trace(args)
    before, after = trace[:n_before], trace[n_before:]
    assert n_before == len(after) == 10
    assert all(len(r.images) == 3 and r.prompt_tokens == 32 for r in before)
    assert all(not r.images and r.prompt_tokens == 500 and r.output_tokens == 9 for r in after)
    assert all(a.t <= b.t for a, b in zip(trace, trace[1:], strict=False))
    assert after[0].t > before[-1].t


def test_output_shift_keeps_the_requests_and_lengthens_the_outputs() -> None:
    # EPDServe Table 6: outputs 50 -> 500 tokens, images and prompts unchanged
    trace, n_before = shift_trace(shift_args("--shift", "outputs", "--rate", "2", "--phase-seconds", "5"))
    before, after = trace[:n_before], trace[n_before:]
    assert all(len(r.images) == 1 and r.prompt_tokens == 32 and r.output_tokens == 50 for r in before)
    assert all(len(r.images) == 1 and r.prompt_tokens == 32 and r.output_tokens == 500 for r in after)
    trace, n_before = shift_trace(shift_args("--shift", "outputs", "--phase-seconds", "5", "--before-output", "20",
                                             "--after-output", "200", "--after-images", "0"))
    assert {(len(r.images), r.output_tokens) for r in trace[n_before:]} == {(0, 200)}
    assert {(len(r.images), r.output_tokens) for r in trace[:n_before]} == {(1, 20)}


def test_planner_gets_the_bench_thresholds_and_no_encoder_scaling() -> None:
    a = planner_args(shift_args("--interval", "1.5", "--sustain", "4"))
    assert a[a.index("--interval") + 1] == "1.5" and a[a.index("--sustain") + 1] == "4"
    assert "--no-encoder-scaling" in a


def test_the_profile_is_measured_uncapped_at_the_instances_cpu_share(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`triptych profile --cpu-share X` with the instances' threads, in no cgroup: a profile
    timed inside the quota lands on either side of its period's stalls."""
    import subprocess

    ran: list[tuple[list[str], dict]] = []
    out = tmp_path / "profile.json"

    def fake_run(cmd: list[str], **kw: object) -> None:
        ran.append((cmd, kw))
        roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100").save(out)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert measure_profile(tiny_model_path("qwen2-vl"), out, 0.25).source == "roofline:H100"
    (cmd, kw), = ran
    assert cmd[cmd.index("profile") - 2:cmd.index("profile") + 1] == ["-m", "triptych.cli", "profile"]
    assert cmd[cmd.index("--cpu-share") + 1] == "0.25" and cmd[cmd.index("--threads") + 1] == "1"
    assert "preexec_fn" not in kw and kw["env"]["OMP_NUM_THREADS"] == "1"
    ran.clear()
    measure_profile(tiny_model_path("qwen2-vl"), out, None)  # uncapped instances: wall time
    assert "--cpu-share" not in ran[0][0]


def test_error_is_signed_relative_to_the_measurement() -> None:
    assert error_pct(0.11, 0.1) == pytest.approx(10.0)
    assert error_pct(0.05, 0.1) == pytest.approx(-50.0)
    assert error_pct(None, 0.1) is None and error_pct(0.1, 0.0) is None


def cal(ttft: float, tpot: float, burst_tpot: float, cpu: dict[str, float] | None = None) -> Calibration:
    return Calibration(ttft_s=ttft, tpot_s=tpot, burst_tpot_s=burst_tpot, burst=4, cpu_s=cpu or {},
                       template_tokens=20)


def test_fitted_overheads_make_the_lone_request_and_the_burst_match() -> None:
    model = tiny_model_path("qwen2-vl")
    profile = roofline_profile(read_shape(model), "H100")
    topo = parse_topology("1E1P1D")
    lone = with_template([TraceRequest(t=0, images=[(224, 224)], prompt_tokens=30, output_tokens=9)], 20)
    burst = [lone[0]] * 4
    assert lone[0].prompt_tokens == 50
    cfg = SimConfig()
    # A burst of 4 decodes only a little slower than one: most of the served path's cost
    # per token is per step (shared by the batch), the rest per request.
    fit = fit_overheads(topo, profile, lone, cfg, cal(0.08, 0.006, 0.0075), fit_request_work=False)
    assert fit.cfg.request_work_s == {}
    assert fit.profile.step_overhead_s > 0 and fit.profile.decode_token_overhead_s > 0
    sim = simulate(topo, fit.profile, lone, fit.cfg)
    assert sim.tpot_p50_s == pytest.approx(0.006, rel=0.01)
    assert simulate(topo, fit.profile, burst, fit.cfg).tpot_p50_s == pytest.approx(0.0075, rel=0.02)
    assert sim.ttft_p50_s == pytest.approx(0.08, rel=1e-6)
    # A burst as fast as one request: all of it per step.
    fit = fit_overheads(topo, profile, lone, cfg, cal(0.08, 0.006, 0.006), fit_request_work=False)
    assert fit.profile.decode_token_overhead_s == pytest.approx(0.0, abs=2e-5)
    assert simulate(topo, fit.profile, lone, fit.cfg).tpot_p50_s == pytest.approx(0.006, rel=0.01)
    # A burst 4x as slow: all of it per request (the per-step share is clamped at 0).
    fit = fit_overheads(topo, profile, lone, cfg, cal(0.08, 0.006, 0.03), fit_request_work=False)
    assert fit.profile.step_overhead_s == 0.0 and fit.profile.decode_token_overhead_s > 0
    assert simulate(topo, fit.profile, lone, fit.cfg).tpot_p50_s == pytest.approx(0.006, rel=0.01)


def test_request_work_is_cpu_at_the_quota_beyond_the_steps() -> None:
    # The profile is measured at the quota, so its steps are wall time at X CPUs: a type's
    # CPU seconds per lone request take 1/X as long; what its steps do not cover is
    # request work. The lone request's TPOT and TTFT still match.
    profile = roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100")
    topo = parse_topology("1E1P1D")
    lone = with_template([TraceRequest(t=0, images=[(224, 224)], prompt_tokens=30, output_tokens=9)], 20)
    cfg = SimConfig()
    cpu = {"E": 0.01, "P": 0.012, "D": 0.01}
    fit = fit_overheads(topo, profile, lone, cfg, cal(0.08, 0.006, 0.0075, cpu), instance_cpus=0.5)
    steps = Simulation(topo, fit.profile, cfg)
    steps.run(lone)
    for inst in steps.instances:
        want = max(0.0, cpu[inst.kind.value] * 2 - inst.busy_time)
        assert fit.cfg.request_work_s[inst.kind.value] == pytest.approx(want, rel=0.05, abs=1e-5)
    assert fit.cfg.request_work_s["E"] > 0 and fit.cfg.request_work_s["P"] > 0
    sim = simulate(topo, fit.profile, lone, fit.cfg)
    assert sim.tpot_p50_s == pytest.approx(0.006, rel=0.02) and sim.ttft_p50_s == pytest.approx(0.08, rel=1e-6)


def test_tables_print_every_row() -> None:
    row = {"topology": "EPD", "rate": 2.0, "completed": 3, "num_requests": 3, "load_avg_1m": 1.5}
    for m in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"):
        row |= {f"measured_{m}": 0.1, f"simulated_{m}": 0.11, f"error_{m}": 10.0}
    text = format_table([row])
    assert "EPD" in text and "4/4 within 15%" in text
    phase = {"slo_attainment": 1.0, "ttft_p90_s": 0.2}
    run = {"mode": "autoscale", "before": phase, "after": phase, "after_2nd_half": phase, "lost": 0,
           "load_avg_1m": 2.0, "planner": {"counts": {"E": 1, "P": 2, "D": 1}, "decisions": 5, "actions": [
               {"t_s": 3.0, "action": "switch_role", "reason": "reactive: move one E to P"}]}}
    text = format_report([run])
    assert "move one E to P" in text and '{"E": 1, "P": 2, "D": 1}' in text


@pytest.mark.slow
def test_simulate_validate_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100").save(profile)
    argv = ["bench", "simulate-validate", "--topologies", "EPD", "--rates", "2", "--num-requests", "3",
            "--output-tokens", "4", "--profile", str(profile), "--instance-cpus", "1", "--json",
            "--calibration-warmups", "2", "--calibration-requests", "5",
            "--out-json", str(tmp_path / "sv.json")]
    assert main(argv) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)["rows"]
    # The topology's table went to stderr as soon as it was measured, before the report.
    assert "TTFT p50" in out.err and "TPOT p90" in out.err
    assert json.loads((tmp_path / "sv.json").read_text())["complete"] is True
    assert len(rows) == 1 and rows[0]["completed"] == 3
    assert rows[0]["measured_ttft_p50_s"] > 0 and rows[0]["simulated_ttft_p50_s"] > 0
    assert rows[0]["error_ttft_p50_s"] is not None
    # The simulator batched under the budgets the workers reported: the engine's defaults.
    assert rows[0]["instance_budgets"] == {"EPD": [DEFAULT_TOKEN_BUDGET, DEFAULT_IMAGE_BUDGET]}
    # The instance's idle CPU, measured before the timed requests, was taken out of theirs.
    calibration, = rows[0]["calibrations"]
    assert set(calibration["idle_cores"]) == {"EPD"} and 0 <= calibration["idle_cores"]["EPD"] < 0.5
    # Five timed lone requests (--calibration-requests), each one spread around their median.
    assert len(calibration["ttft_noise_s"]) == 5 and len(calibration["tpot_noise"]) == 5


@pytest.mark.slow
def test_autoscale_shift_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "autoscale-shift", "--topology", "1E1P1D", "--rate", "2", "--phase-seconds", "1.5",
            "--after-prompt", "40", "--before-output", "3", "--after-output", "3", "--interval", "0.5",
            "--instance-cpus", "1", "--json"]
    assert main(argv) == 0
    runs = {r["mode"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert set(runs) == {"autoscale", "static"}
    for r in runs.values():
        assert r["lost"] == 0 and r["before"]["requests"] == r["after"]["requests"] == 3
    assert runs["autoscale"]["planner"]["decisions"] >= 1 and runs["static"]["planner"] is None
    assert runs["autoscale"]["planner"]["counts"] == {"E": 1, "P": 1, "D": 1}  # 1E1P1D: nothing may move


@pytest.mark.parametrize("beside", [True, False])
def test_ttft_overhead_goes_negative_when_request_work_would_delay_the_first_token(beside: bool) -> None:
    # Request work is charged up front, but a prefilling instance's share partly comes after
    # the first token (serving the KV pull) and an encoding instance's after its hand-off: a
    # lone TTFT shorter than the steps plus that work gives a negative overhead, at most
    # the encoding and prefilling types' request work.
    profile = roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100")
    topo = parse_topology("1E1P1D")
    lone = with_template([TraceRequest(t=0, images=[(224, 224)], prompt_tokens=30, output_tokens=9)], 20)
    cpu = {"E": 0.01, "P": 0.02, "D": 0.01}
    cfg = SimConfig(request_work_beside=beside)
    fit = fit_overheads(topo, profile, lone, cfg, cal(0.03, 0.006, 0.0075, cpu), instance_cpus=0.5)
    work = fit.cfg.request_work_s
    assert -work["P"] <= fit.cfg.ttft_overhead_s < 0
    assert simulate(topo, fit.profile, lone, fit.cfg).ttft_p50_s == pytest.approx(0.03, rel=1e-6)
    # Faster still: more than the P's work comes off, never more than the E's and P's.
    charged = simulate(topo, fit.profile, lone, fit.cfg.model_copy(update={"ttft_overhead_s": 0.0})).ttft_p50_s
    faster = charged - work["P"] - work["E"] / 2
    fit = fit_overheads(topo, profile, lone, cfg, cal(faster, 0.006, 0.0075, cpu), instance_cpus=0.5)
    assert fit.cfg.request_work_s == pytest.approx(work)
    assert -(work["E"] + work["P"]) <= fit.cfg.ttft_overhead_s < -work["P"]
    assert simulate(topo, fit.profile, lone, fit.cfg).ttft_p50_s == pytest.approx(faster, rel=1e-6)
    # Faster than the steps alone: the bound holds.
    fit = fit_overheads(topo, profile, lone, cfg, cal(1e-4, 0.006, 0.0075, cpu), instance_cpus=0.5)
    work = fit.cfg.request_work_s
    assert fit.cfg.ttft_overhead_s == pytest.approx(-(work["E"] + work["P"]))
    assert simulate(topo, fit.profile, lone, fit.cfg).ttft_p50_s > 1e-4


def test_cpu_per_request_leaves_out_what_the_instances_burn_idle() -> None:
    """15 lone requests over 10.5 s: an E that spent 0.27 s of CPU, 0.006 cores of it idle
    (0.063 s), did 13.8 ms per request, not 18; background over the spent is never negative."""
    got = request_cpu_s({"E": 0.27, "D": 0.05}, {"E": 0.006, "D": 0.01}, 10.5, 15)
    assert got["E"] == pytest.approx((0.27 - 0.063) / 15) and got["D"] == 0.0
    assert request_cpu_s({"EPD": 0.3}, {}, 10.0, 15) == {"EPD": pytest.approx(0.02)}  # none measured


def test_calibrations_pool_into_medians_mean_cpu_and_every_spread() -> None:
    a = Calibration(0.04, 0.006, 0.008, 4, {"E": 0.01, "D": 0.02}, 20, [-0.002, 0.0, 0.003], [0.9, 1.0, 1.2])
    b = Calibration(0.05, 0.007, 0.009, 4, {"E": 0.03}, 20, [0.0, 0.05], [1.0, 1.5])
    c = Calibration(0.08, 0.010, 0.012, 4, {"E": 0.02, "D": 0.04}, 20, [0.0], [1.0])
    one = pooled([a, b, c])
    assert (one.ttft_s, one.tpot_s, one.burst_tpot_s) == (0.05, 0.007, 0.009)
    assert one.cpu_s == pytest.approx({"D": 0.03, "E": 0.02})
    assert one.idle_cores == {"D": 0.0, "E": 0.0}  # none measured in these
    assert one.burst_ttft_s is None  # none measured either
    timed = pooled([dataclasses.replace(a, burst_ttft_s=0.2), b, dataclasses.replace(c, burst_ttft_s=0.4)])
    assert timed.burst_ttft_s == pytest.approx(0.3)  # the median of those measured
    # one from each deployment in turn: a short trace still draws from every one of them
    assert one.ttft_noise_s == [-0.002, 0.0, 0.0, 0.0, 0.05, 0.003]
    assert one.noise()["tpot_noise"] == [0.9, 1.0, 1.0, 1.0, 1.5, 1.2]
    assert pooled([a]) is a


def test_repeated_runs_give_the_median_and_their_spread() -> None:
    def report(ttft: float | None) -> dict[str, object]:
        return {"completed": 24, "num_requests": 24, "ttft_p50_s": ttft, "ttft_p90_s": 0.08,
                "tpot_p50_s": 0.006, "tpot_p90_s": None}
    cells = measured_cells([report(0.04), report(0.06)])
    assert cells["completed"] == cells["num_requests"] == 48 and cells["runs"] == 2
    assert cells["measured_ttft_p50_s"] == pytest.approx(0.05)
    assert cells["measured_ttft_p50_s_runs"] == [0.04, 0.06]
    assert cells["repeat_spread_ttft_p50_s"] == pytest.approx(40.0)
    assert cells["repeat_spread_ttft_p90_s"] == 0.0
    assert cells["measured_tpot_p90_s"] is None and cells["repeat_spread_tpot_p90_s"] is None
    assert measured_cells([report(0.04)])["repeat_spread_ttft_p50_s"] is None  # one run: no spread
    row = {"topology": "EPD", "rate": 2.0, "load_avg_1m": 1.0, **cells}
    for m in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"):
        row[f"simulated_{m}"], row[f"error_{m}"] = 0.05, 0.0
    text = format_table([row])
    assert "repeat%" in text.splitlines()[0] and "40.0" in text
    assert "1/3 cells whose runs differ by more than 15%" in text



def test_two_deployments_are_simulated_from_their_pooled_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_topology over two stubbed deployments of EPD, the second on a host 1.5x slower:
    one fit to the medians of their calibrations, the measured medians against it, and each
    deployment's own calibration kept in the report (to refit offline)."""
    import triptych.bench.sim_validate as sv

    fast = Calibration(0.08, 0.006, 0.0075, 4, {"EPD": 0.03}, 20, [0.0], [1.0], burst_ttft_s=0.2)
    slow = Calibration(0.12, 0.009, 0.01125, 4, {"EPD": 0.045}, 20, [0.0], [1.0], burst_ttft_s=0.3)

    def report(c: Calibration) -> dict[str, object]:
        return {"completed": 3, "num_requests": 3, "ttft_p50_s": c.ttft_s, "ttft_p90_s": c.ttft_s,
                "tpot_p50_s": c.tpot_s, "tpot_p90_s": c.tpot_s}

    served = {"EPD": (2048, 8)}  # what the deployments' workers report (the engine's defaults)
    runs = iter([sv.MeasuredRun(fast, [report(fast)], 0.5, served), sv.MeasuredRun(slow, [report(slow)], 0.7, served)])
    monkeypatch.setattr(sv, "measure_topology", lambda *a, **k: next(runs))
    args = build_parser().parse_args(["bench", "simulate-validate", "--topologies", "EPD", "--rates", "0.1",
                                      "--repeats", "2", "--instance-cpus", "1"])
    profile = roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100")
    trace = [TraceRequest(t=float(i), images=[(224, 224)], prompt_tokens=30, output_tokens=9) for i in range(3)]
    row, = sv.run_topology("EPD", parse_topology("EPD"), Path("unused"), profile, trace, args)
    # At 0.1 req/s nothing queues: the simulation reproduces the pooled lone request.
    assert row["measured_tpot_p50_s"] == pytest.approx(0.0075) and row["measured_tpot_p50_s_runs"] == [0.006, 0.009]
    assert row["simulated_tpot_p50_s"] == pytest.approx(0.0075, rel=0.02)
    assert row["simulated_ttft_p50_s"] == pytest.approx(0.1, rel=0.02)
    assert abs(row["error_tpot_p50_s"]) < 2 and row["repeat_spread_tpot_p50_s"] == pytest.approx(40.0)
    assert [c["tpot_s"] for c in row["calibrations"]] == [0.006, 0.009] and row["load_avg_1m"] == 0.7
    assert Calibration(**row["calibrations"][1]) == slow
    assert row["instance_budgets"] == served  # the simulator batched as the deployments did
    # The burst beside the simulator's: four taken on at once wait longer than one.
    assert row["burst_ttft_s"] == pytest.approx(0.25)
    assert row["simulated_burst_ttft_s"] > row["simulated_ttft_p50_s"]


def test_the_simulated_instances_take_the_budgets_they_are_given_per_type() -> None:
    """`SimConfig.instance_budgets` (a measured deployment's) over the SLO-derived budgets,
    for the types it names; the others keep theirs."""
    from triptych.operator.planner.simulator import build_instances

    profile = roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100")
    topology = parse_topology("1E1P1D")
    derived = {i.kind.value: (i.token_budget, i.image_budget) for i in build_instances(topology, profile, SimConfig())}
    assert derived["P"] != (2048, 8)
    given = build_instances(topology, profile, SimConfig(instance_budgets={"P": (2048, 8)}))
    assert {i.kind.value: (i.token_budget, i.image_budget) for i in given} == {**derived, "P": (2048, 8)}


def test_a_saved_run_is_compared_again_without_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--resimulate`: a saved run's measurements and calibrations against the simulator as
    it is now; nothing is measured, the same simulator gives the same rows, and
    `--no-request-work-beside` gives the other request-work model's."""
    import triptych.bench.sim_validate as sv

    c = Calibration(0.08, 0.006, 0.0075, 4, {"EPD": 0.2}, 20, [0.0, 0.01], [1.0, 1.1], burst_ttft_s=0.2)
    measured = {"completed": 6, "num_requests": 6, "ttft_p50_s": 0.2, "ttft_p90_s": 0.3,
                "tpot_p50_s": 0.01, "tpot_p90_s": 0.012}
    monkeypatch.setattr(sv, "measure_topology", lambda *a, **k: sv.MeasuredRun(c, [measured, measured], 0.5,
                                                                              {"EPD": (2048, 8)}))
    profile = tmp_path / "profile.json"
    roofline_profile(read_shape(tiny_model_path("qwen2-vl")), "H100").save(profile)
    saved = tmp_path / "sv.json"
    common = ["bench", "simulate-validate", "--profile", str(profile), "--instance-cpus", "0.5"]
    assert main([*common, "--topologies", "EPD", "--rates", "1", "30", "--num-requests", "6",
                 "--out-json", str(saved), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["rows"]

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("--resimulate measured a deployment")
    monkeypatch.setattr(sv, "measure_topology", never)
    doc = json.loads(saved.read_text())
    assert doc["workload"]["num_requests"] == 6 and "seed" in doc["workload"]
    args = build_parser().parse_args([*common, "--resimulate", str(saved)])
    again = sv.resimulate(doc, sv.StepProfile.load(profile), args)
    keys = [f"{kind}_{m}" for kind in ("measured", "simulated", "error") for m in sv.METRICS]
    assert [[r[k] for k in keys] for r in again] == [pytest.approx([r[k] for k in keys]) for r in first]
    assert first[0]["request_work_s"]["EPD"] > 0.1
    other = sv.resimulate(doc, sv.StepProfile.load(profile), build_parser().parse_args(
        [*common, "--resimulate", str(saved), "--no-request-work-beside"]))
    assert other[0]["simulated_ttft_p50_s"] == pytest.approx(first[0]["simulated_ttft_p50_s"])  # nothing queues
    assert other[1]["simulated_ttft_p90_s"] != pytest.approx(first[1]["simulated_ttft_p90_s"])
    assert main([*common, "--resimulate", str(saved)]) == 0
    assert "EPD" in capsys.readouterr().out
    assert main(["bench", "simulate-validate", "--resimulate", str(saved)]) == 2  # which profile?
