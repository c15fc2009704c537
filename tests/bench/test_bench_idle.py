"""`triptych bench idle`: CPU time read from /proc/PID/stat (all threads), the failure
paths, and the command end to end against a real local deployment."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from triptych.bench.errors import BenchError
from triptych.bench.idle_cpu import (
    ProcessCpu,
    cpu_seconds,
    idle_report,
    parse_stat,
    runnable_delta_s,
    sample_cpu,
)
from triptych.cli import main


def test_stat_fields_are_counted_after_the_last_parenthesis() -> None:
    # comm may hold spaces and ')'; utime=111 and stime=22 are fields 14 and 15.
    fields_after_comm = ["S", "1", "2", "3", "0", "-1", "4194560", "10", "0", "0", "0", "111", "22", "5", "6"]
    stat = "4242 (we) ird (name) " + " ".join(fields_after_comm) + "\n"
    assert parse_stat(stat) == ("S", 133)


def test_runnable_time_counts_live_and_new_threads() -> None:
    # Thread 1 grew by 20 ns, thread 3 was born (7 ns), thread 2 died (its time is lost).
    assert runnable_delta_s({1: 10, 2: 5}, {1: 30, 3: 7}) == pytest.approx(27e-9)


BURN = """
import sys, threading, time
print("ready", flush=True)
sys.stdin.readline()
def burn():  # CPU time of this thread, not wall time: independent of the machine's load
    t = time.thread_time()
    while time.thread_time() - t < 0.3:
        pass
threads = [threading.Thread(target=burn) for _ in range(2)]
for th in threads: th.start()
for th in threads: th.join()
print("done", flush=True)
sys.stdin.readline()
"""


def test_cpu_seconds_counts_every_thread_of_the_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = cpu_seconds(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        used = cpu_seconds(child.pid) - before
        # Two threads burnt 0.3 s each (clock ticks are 10 ms; thread start-up costs a little).
        assert 0.55 <= used <= 0.9, used
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_process_that_exits_during_the_window_is_an_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        with pytest.raises(BenchError, match=r"worker-E-0 \(pid \d+\) exited"):
            sample_cpu({"worker-E-0": child.pid}, seconds=1.5)
    finally:
        child.wait(timeout=10)
    with pytest.raises(BenchError):
        sample_cpu({"x": child.pid}, seconds=0)


def test_a_sleeping_process_uses_no_cores_and_the_max_is_reported() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # past the interpreter's start-up
        procs = sample_cpu({"sleeper": child.pid}, seconds=0.5)
        assert procs[0].name == "sleeper" and procs[0].pid == child.pid
        assert procs[0].cpu_s <= 0.02 and procs[0].cores <= 0.04
        assert procs[0].runnable_cores is not None and procs[0].runnable_cores <= 0.04
    finally:
        child.kill()
        child.wait(timeout=10)
    rep = idle_report([*procs, ProcessCpu("router", 1, 1.0, 0.5)])
    assert rep["idle_cpu_cores"] == 0.5 and [p["name"] for p in rep["processes"]] == ["sleeper", "router"]


def test_bad_topology_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "idle", "--topology", "3X", "--seconds", "1"])
    assert exc.value.code == 2
    assert "argument --topology: cannot parse topology '3X'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_idle_json_against_a_local_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "idle", "--topology", "EPD", "--seconds", "1", "--settle", "0", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in rep["processes"]] == ["worker-EPD-0", "router"]
    assert all(p["pid"] > 0 and p["cpu_s"] >= 0 and p["cores"] >= 0 for p in rep["processes"])
    assert all(p["runnable_cores"] >= p["cores"] - 0.02 for p in rep["processes"])  # ticks vs ns
    assert rep["idle_cpu_cores"] == max(p["cores"] for p in rep["processes"])
    assert rep["window_s"] == 1 and rep["topology"] == "EPD"
