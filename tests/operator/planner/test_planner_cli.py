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


# A small Qwen2-VL (the size of the built-in tiny model's family): on an H100 roofline each
# instance serves thousands of requests a second, so 15 s of arrivals per simulated run
# would be hundreds of thousands of requests (`plan` took 9 minutes for 1,000 instances).
SMALL_QWEN2_VL = {**QWEN2_VL_7B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 1000,
                  "vision_config": {**QWEN2_VL_7B["vision_config"], "depth": 1, "embed_dim": 32, "hidden_size": 64,
                                    "num_heads": 2}}


@pytest.fixture
def run_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The arrivals of every simulated run (goodput searches and the optimizer's own runs)."""
    from triptych.operator.planner import optimizer, simulator

    sizes: list[int] = []
    real = simulator.simulate

    def counting(topology, profile, trace, cfg, stop_below=None):  # type: ignore[no-untyped-def]
        sizes.append(len(trace))
        return real(topology, profile, trace, cfg, stop_below)

    monkeypatch.setattr(simulator, "simulate", counting)
    monkeypatch.setattr(optimizer, "simulate", counting)
    return sizes


@pytest.mark.parametrize(("flag", "cap"), [([], 10_000), (["--max-sim-requests", "400", "--num-requests", "200"], 400)])
def test_plan_bounds_every_simulated_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], run_sizes: list[int],
                                         flag: list[str], cap: int) -> None:
    model = write_model(tmp_path / "m", SMALL_QWEN2_VL)
    assert main(["plan", "--model", str(model), "--gpu", "H100", "--instances", "1000", "--json", *flag]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sum(result["counts"].values()) == 1000 and result["predicted_goodput_rps"] > 0
    assert len(run_sizes) == result["simulations"] and max(run_sizes) == cap  # the cap binds, and holds


def test_simulate_goodput_bounds_its_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          run_sizes: list[int]) -> None:
    model = write_model(tmp_path / "m", SMALL_QWEN2_VL)
    assert main(["simulate", "--model", str(model), "--gpu", "H100", "--topology", "1E1P1D", "--goodput",
                 "--num-requests", "100", "--max-sim-requests", "600", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goodput"]["goodput_rps"] > 0 and out["goodput"]["simulations"] == len(run_sizes) >= 2
    assert max(run_sizes) == 600


def test_simulate_needs_a_profile_source(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--topology", "EPD"])  # neither --profile nor --gpu


@pytest.mark.parametrize("argv", [["simulate", "--gpu", "H100", "--topology", "1X"], ["serve", "--topology", "2Q"],
                                  ["bench", "serve", "--topologies", "EPD,1X"], ["bench", "switch", "--topology", "E"]])
def test_bad_topology_is_an_argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cannot parse topology" in err or "runs no instance for stage" in err, err


def test_bad_inputs_are_one_line_errors_naming_them(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", QWEN2_VL_7B)
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "images": [], "prompt_tokens": 5, "output_tokens": 3}\n{"t": 1, "images": []}\n')
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    common = ["--model", str(model), "--slo-ttft", "1", "--slo-tbt", "0.1"]
    cases = [
        (["plan", *common, "--instances", "4", "--gpu", "H100", "--workload", str(trace)],
         f"triptych plan: {trace}:2: not a trace request: prompt_tokens: Field required; output_tokens: Field required"),
        (["plan", *common, "--instances", "4", "--gpu", "H100", "--workload", str(tmp_path / "none.jsonl")],
         "triptych plan: [Errno 2] No such file or directory"),
        (["simulate", *common, "--topology", "EPD", "--profile", str(profile)], "triptych simulate: source: Field required"),
        (["plan", "--model", str(tmp_path / "nowhere"), "--instances", "4", "--gpu", "H100"],
         "triptych plan: cannot read"),
        (["simulate", *common[:2], "--slo-ttft", "0", "--topology", "EPD", "--gpu", "H100"],
         "triptych simulate: ttft_slo_s: Input should be greater than 0"),
        (["workload", "--out", str(tmp_path / "no" / "dir.jsonl")], "triptych workload: [Errno 2]"),
        (["workload", "--out", str(tmp_path / "w.jsonl"), "--num-requests", "0"],
         "triptych workload: num_requests: Input should be greater than or equal to 1"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert isinstance(exc.value.code, str) and exc.value.code.startswith(message), (argv, exc.value.code)
        assert "\n" not in exc.value.code


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "--instances", "0"], "argument --instances: must be at least 1, got 0"),
    (["simulate", "--rates", "1", "0"], "argument --rates: must be a positive number of requests/s, got 0"),
    (["workload", "--rate", "-2"], "argument --rate: must be a positive number of requests/s, got -2"),
])
def test_bad_counts_and_rates_are_argparse_errors(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


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
