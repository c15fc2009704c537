"""CPU binding for local deployments (triptych/cpu_binding.py): each engine gets cores of its
own and the router and the workers' other threads the rest, only where that fits; CPU lists
parse and print as Linux writes them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triptych.cli import build_parser
from triptych.cpu_binding import BindingUnavailable, format_cpu_list, parse_cpu_list, plan
from triptych.local import LocalDeployment
from triptych.topology import InstanceType as T


def test_one_instance_on_two_cpus_takes_the_second_and_leaves_the_first_to_the_router() -> None:
    binding = plan([0, 1], ["worker-EPD-0"], 1)
    assert binding.service == (0,) and binding.engines == {"worker-EPD-0": (1,)}
    assert binding.describe() == "engines: worker-EPD-0 on CPU 1; router and service threads on CPU 0"


def test_instances_get_disjoint_blocks_of_their_thread_count_from_the_top() -> None:
    binding = plan(range(16), ["a", "b", "c"], 5)
    assert binding.service == (0,)
    assert binding.engines == {"a": (1, 2, 3, 4, 5), "b": (6, 7, 8, 9, 10), "c": (11, 12, 13, 14, 15)}
    binding = plan(range(16), ["a", "b", "c"], 2)
    assert binding.service == tuple(range(10)) and binding.engines["c"] == (14, 15)


def test_a_cpuset_with_gaps_is_used_as_it_is() -> None:
    binding = plan([9, 2, 6, 5], ["a"], 2)
    assert binding.service == (2, 5) and binding.engines == {"a": (6, 9)}


def test_no_binding_when_the_instances_leave_no_cpu_for_the_router() -> None:
    with pytest.raises(BindingUnavailable, match=r"2 instance\(s\) x 1 thread\(s\) and a CPU for the router "
                                                 r"need 3 CPUs; this process may use 2"):
        plan([0, 1], ["a", "b"], 1)
    with pytest.raises(BindingUnavailable):
        plan([0, 1, 2, 3], ["a"], 4)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        plan([0, 1], ["a"], 0)


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list(" 5 ") == (5,)
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    for bad, why in [("", "not a CPU list"), ("a", "not a CPU list"), ("1-", "not a CPU list"),
                     ("-1", "not a CPU list"), ("3-1", "runs backwards"), ("1,,2", "not a CPU list")]:
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad)


@given(st.sets(st.integers(0, 300), min_size=1))
def test_format_and_parse_round_trip(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == tuple(sorted(cpus))


def test_worker_cpu_flags_parse_and_a_bad_list_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["worker", "--model", "m", "--engine-cpus", "2-3", "--service-cpus", "0"])
    assert args.engine_cpus == (2, 3) and args.service_cpus == (0,)
    assert build_parser().parse_args(["serve"]).cpu_binding == "off"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["worker", "--model", "m", "--engine-cpus", "3-1"])
    assert exc.value.code == 2
    assert "argument --engine-cpus: not a CPU list: '3-1' (3-1 runs backwards)" in capsys.readouterr().err




def test_a_deployment_passes_each_worker_its_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("triptych.local.available_cpus", lambda: list(range(8)))
    dep = LocalDeployment(model=tmp_path, topology={T.E: 1, T.PD: 1, T.V: 1}, threads=2, cpu_binding=True)
    dep.plan_binding()
    assert dep.binding is not None and dep.binding.service == (0, 1)
    assert dep._binding_args("worker-E-0", T.E) == ["--engine-cpus", "2-3", "--service-cpus", "0-1"]
    assert dep._binding_args("worker-PD-0", T.PD) == ["--engine-cpus", "4-5", "--service-cpus", "0-1"]
    # A video decoder has no engine: the whole process runs on its own cores.
    assert dep._binding_args("worker-V-0", T.V) == ["--service-cpus", "6-7"]
    assert "CPU binding: engines: worker-E-0 on CPU 2-3" in capsys.readouterr().err


def test_no_binding_with_quotas_without_room_or_when_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("triptych.local.available_cpus", lambda: [0, 1])
    quota = LocalDeployment(model=tmp_path, topology={T.EPD: 1}, cpu_binding=True, instance_cpus=0.5)
    off = LocalDeployment(model=tmp_path, topology={T.EPD: 1})
    crowded = LocalDeployment(model=tmp_path, topology={T.E: 2, T.P: 2, T.D: 2}, cpu_binding=True)
    for dep in (quota, off, crowded):
        dep.plan_binding()
        assert dep.binding is None and dep._binding_args("worker-EPD-0", T.EPD) == []
    assert quota.binding_error == "--instance-cpus shares the cores out by quota"
    assert crowded.binding_error is not None and "need 7 CPUs; this process may use 2" in crowded.binding_error
    assert "CPU binding off: 6 instance(s)" in capsys.readouterr().err
