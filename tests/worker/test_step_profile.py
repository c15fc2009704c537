"""`triptych profile` measures a StepProfile the planner can load and simulate with."""

from __future__ import annotations

from pathlib import Path

import pytest

from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.simulator import SimConfig, simulate
from triptych.operator.planner.workload import WorkloadSpec, fixed, generate
from triptych.tiny_model import tiny_model_path
from triptych.topology import InstanceType as T
from triptych.worker.step_profile import monotone, profile_engine


@pytest.mark.slow
def test_measured_profile_loads_and_drives_the_simulator(tmp_path: Path) -> None:
    model = str(tiny_model_path("qwen2-vl"))
    prof = profile_engine(model, threads=1, pixels=(56, 112), images=(1, 2), tokens=(16, 64), batches=(1, 4),
                          contexts=(32, 128))
    assert prof.source == "measured:cpu" and prof.dtype_bytes == 4
    assert [r.pixels for r in prof.encode] == [56 * 56, 112 * 112]
    assert [p.x for p in prof.prefill] == [16, 64] and [r.context for r in prof.decode] == [32, 128]
    for curve in [prof.prefill] + [r.points for r in prof.decode] + [r.points for r in prof.encode]:
        secs = [p.seconds for p in curve]
        assert secs == sorted(secs) and secs[0] > 0
    assert prof.kv_capacity_tokens > 0 and prof.migration.bytes_per_s > 0
    prof.save(tmp_path / "p.json")
    loaded = StepProfile.load(tmp_path / "p.json")
    trace = generate(WorkloadSpec(rate=0.5, num_requests=5, images_per_request=fixed(1), image_size=(64, 64),
                                  prompt_tokens=fixed(8), output_tokens=fixed(4)))
    report = simulate({T.E: 1, T.P: 1, T.D: 1}, loaded, trace, SimConfig(ttft_slo_s=30, tbt_slo_s=10))
    assert report.completed == 5


def test_monotone_lifts_noise_to_the_running_maximum() -> None:
    from triptych.operator.planner.profile import Point

    pts = monotone([Point(x=4, seconds=0.2), Point(x=1, seconds=0.3), Point(x=2, seconds=0.1)])
    assert [(p.x, p.seconds) for p in pts] == [(1, 0.3), (2, 0.3), (4, 0.3)]


def test_measure_takes_the_median_by_the_given_clock() -> None:
    from triptych.worker.step_profile import measure

    ticks = iter([0.0, 0.1, 1.0, 1.5, 2.0, 2.2])  # runs of 0.1, 0.5 and 0.2 s
    assert measure(lambda: None, 3, clock=lambda: next(ticks)) == pytest.approx(0.2)


def test_a_cpu_share_profile_times_cpu_seconds_and_divides_by_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cpu-share X`: every table is this process's CPU seconds over X (the quota's average
    rate), never wall time."""
    import time

    from triptych.worker import step_profile

    clocks = []

    def fake_measure(run: object, repeats: int, clock: object = time.perf_counter) -> float:
        clocks.append(clock)
        return 0.01

    monkeypatch.setattr(step_profile, "measure", fake_measure)
    prof = profile_engine(str(tiny_model_path("qwen2-vl")), threads=1, pixels=(56,), images=(1,), tokens=(16,),
                          batches=(1,), contexts=(32,), migration_bytes_per_s=1e9, cpu_share=0.25)
    assert prof.source == "measured:cpu at 0.25 CPUs"
    points = [*prof.prefill, *prof.encode[0].points, *prof.decode[0].points]
    assert [p.seconds for p in points] == [pytest.approx(0.04)] * 3
    assert clocks and all(c is time.process_time for c in clocks)


def test_a_cpu_share_needs_the_cpu_and_a_positive_share() -> None:
    with pytest.raises(ValueError, match="a CPU share needs --device cpu"):
        profile_engine("unused", device="cuda", cpu_share=0.5)
    with pytest.raises(ValueError, match="a share > 0"):
        profile_engine("unused", cpu_share=0.0)


def test_the_cli_refuses_a_cpu_share_on_another_device(capsys: pytest.CaptureFixture[str]) -> None:
    from triptych.cli import main

    assert main(["profile", "--model", "tiny", "--out", "unused.json", "--cpu-share", "0.5", "--device", "cuda"]) == 2
    assert "--cpu-share profiles a CPU instance; got --device cuda" in capsys.readouterr().err


def test_a_decode_batch_longer_to_prefill_than_its_timed_steps_is_measured() -> None:
    """16 rows of 64 tokens at a 64-token budget take 16 steps to prefill, while the first
    rows decode: none may finish before the timed steps (it hung for the 600 s deadline,
    `triptych profile`'s default batch 16 x context 1024), and the engine is left empty."""
    from triptych.worker.engine.engine import Engine, EngineConfig
    from triptych.worker.step_profile import measure_decode

    engine = Engine(EngineConfig(model=str(tiny_model_path("qwen2-vl")), role=T.EPD, threads=1, token_budget=64,
                                 detokenize=False))
    assert measure_decode(engine, 16, 64) > 0
    assert not engine.has_work and engine.kv is not None and engine.kv.num_used == 0
