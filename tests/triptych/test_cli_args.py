"""Options several subcommands share parse the same everywhere: a bad CPU share or thread
count is an argparse error naming the option, before anything starts."""

from __future__ import annotations

import pytest

from triptych.cli import build_parser


@pytest.mark.parametrize("argv", [["serve", "--threads", "2"], ["worker", "--model", "m", "--threads", "2"]])
def test_threads_parse_as_a_whole_number(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).threads == 2


@pytest.mark.parametrize(("value", "message"), [("0", "must be at least 1, got 0"),
                                                ("1.5", "not a whole number: '1.5'")])
def test_a_bad_thread_count_is_refused_with_the_reason(value: str, message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--threads", value])
    assert exc.value.code == 2
    assert f"argument --threads: {message}" in capsys.readouterr().err


def test_a_bad_cpu_share_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--instance-cpus", "-1"])
    assert "argument --instance-cpus: must be a positive number of CPUs, got -1" in capsys.readouterr().err


def test_a_calibration_without_timed_requests_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Its medians would be of nothing: refused at parsing, not a traceback after the deployment starts.
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "simulate-validate", "--calibration-requests", "0"])
    assert exc.value.code == 2
    assert "argument --calibration-requests: must be at least 1, got 0" in capsys.readouterr().err
