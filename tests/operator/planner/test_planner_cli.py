"""`triptych workload`, `simulate` and `plan` end to end through the CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planner_models import QWEN2_VL_7B, write_model

from triptych.cli import main


def test_workload_then_simulate_then_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_model(tmp_path / "m", QWEN2_VL_7B)
    trace = tmp_path / "w.jsonl"
    assert main(["workload", "--out", str(trace), "--rate", "4", "--num-requests", "120",
                 "--images-per-request", "2", "--output-tokens", "40", "--output-sigma", "0.5"]) == 0
    assert len(trace.read_text().splitlines()) == 120
    capsys.readouterr()

    assert main(["simulate", "--model", str(model), "--gpu", "L40S", "--topology", "1E1P1D", "--workload", str(trace),
                 "--rates", "1", "2", "--slo-ttft", "2", "--slo-tbt", "0.1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == "roofline:L40S" and [round(r["rate"]) for r in out["runs"]] == [1, 2]
    run = out["runs"][0]
    assert run["topology"] == {"E": 1, "P": 1, "D": 1} and run["completed"] == 120
    assert {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s",
            "slo_attainment", "throughput_rps"} <= set(run)

    assert main(["plan", "--model", str(model), "--gpu", "L40S", "--instances", "3", "--workload", str(trace),
                 "--slo-ttft", "2", "--slo-tbt", "0.1", "--methods", "E+P+D", "EPD", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["topology"] in ("1E1P1D", "3EPD") and result["instances"] == 3
    assert {c["method"] for c in result["ranking"]} == {"E+P+D", "EPD"}


def test_simulate_needs_a_profile_source(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--topology", "EPD"])  # neither --profile nor --gpu


def test_bad_topology_is_a_clean_error(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN2_VL_7B)
    with pytest.raises(SystemExit, match="cannot parse topology"):
        main(["simulate", "--model", str(model), "--gpu", "H100", "--topology", "1X"])


def test_the_planner_imports_no_torch_and_no_worker_code() -> None:
    import subprocess
    import sys

    code = ("import sys, triptych.operator.planner.cli, triptych.operator.planner.optimizer, "
            "triptych.operator.planner.signals, triptych.operator.planner.policy, "
            "triptych.operator.planner.connectors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('triptych.worker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
