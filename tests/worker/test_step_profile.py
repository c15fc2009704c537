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
