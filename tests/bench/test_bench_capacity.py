"""The capacity rules of the benchmarks: `bench serve --topologies` with --total-cpus splits
the same total evenly over each topology's instances; --instance-cpus caps each alike."""

from __future__ import annotations

import pytest

from triptych.bench.errors import BenchError
from triptych.bench.topologies import cpus_per_instance
from triptych.cli import build_parser


def test_total_cpus_split_evenly_over_instances() -> None:
    assert [cpus_per_instance(n, None, 1.5) for n in (1, 2, 3)] == [1.5, 0.75, 0.5]
    assert cpus_per_instance(3, 0.4, None) == 0.4
    assert cpus_per_instance(3, None, None) is None


def test_both_or_bad_shares_are_refused() -> None:
    with pytest.raises(BenchError, match="not both"):
        cpus_per_instance(2, 0.5, 1.0)
    with pytest.raises(BenchError, match="positive"):
        cpus_per_instance(2, None, -1.0)


@pytest.mark.parametrize("argv", [["serve", "--instance-cpus", "0"], ["serve", "--instance-cpus", "x"],
                                  ["bench", "serve", "--total-cpus", "-1"],
                                  ["bench", "neighbours", "--instance-cpus", "inf"]])
def test_cli_refuses_non_positive_shares(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and "--" in capsys.readouterr().err


def test_bench_serve_refuses_quotas_without_topologies(capsys: pytest.CaptureFixture[str]) -> None:
    from triptych.bench.serve import cli_main

    args = build_parser().parse_args(["bench", "serve", "--url", "http://127.0.0.1:9", "--total-cpus", "1"])
    assert cli_main(args) == 2
    assert "cap the instances --topologies starts" in capsys.readouterr().err
