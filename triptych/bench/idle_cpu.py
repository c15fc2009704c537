"""`triptych bench idle`: the CPU each process of an idle local deployment burns.

An idle server should sleep. This starts a local deployment exactly as `triptych serve`
does (triptych.local), waits until every process is ready (and `settle_s` more, so
start-up work is over), then reads each process's CPU time (utime + stime from
/proc/PID/stat: every thread of the process) at the start and the end of a window and
reports the cores it used, (CPU seconds) / (wall seconds), per process and the most any
one used. Linux only (/proc).

On a machine shared with other load, a process that spins gets less CPU than it asks
for, so `cores` is a lower bound of its idle cost there. Its threads'
/proc/PID/task/TID/schedstat (time on a CPU + time runnable in a run queue) give
`runnable_cores`, an upper bound: a spinning thread would have run all that time, but a
thread that wakes often also counts its wake-up latency. On a quiet machine they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from triptych.bench.errors import BenchError


def parse_stat(stat: str) -> tuple[str, int]:
    """(state, utime + stime in clock ticks) from the text of /proc/PID/stat. The command
    name (field 2) is in parentheses and may hold spaces and ')': the fields after it are
    counted from the last ')'."""
    rest = stat[stat.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    return rest[0], int(rest[11]) + int(rest[12])


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process `pid` has used so far;
    ProcessLookupError once it has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    state, ticks = parse_stat(stat)
    if state in ("Z", "X"):  # exited; a zombie's entry stays until its parent reaps it
        raise ProcessLookupError(pid)
    return ticks / os.sysconf("SC_CLK_TCK")


def runnable_ns_by_thread(pid: int) -> dict[int, int]:
    """Per thread of `pid`: nanoseconds on a CPU + nanoseconds runnable but waiting for one
    (the first two fields of /proc/PID/task/TID/schedstat)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns = f.read().split()[:2]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited meanwhile
        out[int(tid)] = int(run_ns) + int(wait_ns)
    return out


def runnable_delta_s(before: Mapping[int, int], after: Mapping[int, int]) -> float:
    """Seconds runnable between two readings: threads seen in both count their growth,
    threads born in between all of theirs; threads that died in between are lost."""
    return sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


@dataclass
class ProcessCpu:
    name: str
    pid: int
    cpu_s: float
    cores: float  # cpu_s / window_s
    runnable_cores: float | None = None  # (on CPU + waiting for one) / window_s


def sample_cpu(pids: Mapping[str, int], seconds: float) -> list[ProcessCpu]:
    """Cores each process used over a window of `seconds` (wall clock, measured)."""
    if not seconds > 0:
        raise BenchError(f"the window must be > 0 s, got {seconds}")
    if not os.path.isdir("/proc/self"):
        raise BenchError("CPU sampling reads /proc/PID/stat: Linux only")

    def read_all() -> dict[str, tuple[float, dict[int, int]]]:
        out = {}
        for name, pid in pids.items():
            try:
                out[name] = cpu_seconds(pid), runnable_ns_by_thread(pid)
            except ProcessLookupError:
                raise BenchError(f"{name} (pid {pid}) exited during the measurement") from None
        return out

    t0, start = time.monotonic(), read_all()
    time.sleep(seconds)
    end, window = read_all(), time.monotonic() - t0
    procs = []
    for name, pid in pids.items():
        cpu_s = end[name][0] - start[name][0]
        runnable = runnable_delta_s(start[name][1], end[name][1]) if end[name][1] else None
        procs.append(ProcessCpu(name, pid, round(cpu_s, 3), round(cpu_s / window, 3),
                                None if runnable is None else round(runnable / window, 3)))
    return procs


def idle_report(procs: Sequence[ProcessCpu]) -> dict[str, Any]:
    return {"processes": [asdict(p) for p in procs], "idle_cpu_cores": max((p.cores for p in procs), default=0.0)}


def deployment_idle_cpu(dep: Any, seconds: float, settle_s: float = 0.0) -> dict[str, Any]:
    """The idle report of a started triptych.local.LocalDeployment (its router and each
    instance), after `settle_s` of quiet."""
    time.sleep(settle_s)
    return idle_report(sample_cpu({p.name: p.popen.pid for p in dep.processes}, seconds))


def format_idle(rep: Mapping[str, Any]) -> str:
    width = max((len(p["name"]) for p in rep["processes"]), default=7)
    lines = [f"{'process':<{width}}  {'pid':>7}  {'cpu_s':>7}  {'cores':>6}  {'runnable':>8}"]
    lines += [f"{p['name']:<{width}}  {p['pid']:>7}  {p['cpu_s']:>7.2f}  {p['cores']:>6.3f}  "
              f"{'-' if p['runnable_cores'] is None else format(p['runnable_cores'], '.3f'):>8}"
              for p in rep["processes"]]
    lines.append(f"idle CPU (most any one process used): {rep['idle_cpu_cores']:.3f} cores "
                 f"over {rep['window_s']:g} s (runnable: on a CPU or waiting for one)")
    return "\n".join(lines)


def cli_main(args: argparse.Namespace) -> int:
    from triptych.cli_args import resolve_model
    from triptych.local import LocalDeployment, StartupError
    from triptych.topology import parse_topology

    try:
        if not args.seconds > 0 or args.settle < 0:
            raise BenchError(f"need --seconds > 0 and --settle >= 0, got {args.seconds}, {args.settle}")
        dep = LocalDeployment(model=resolve_model(args.model), topology=parse_topology(args.topology),
                              transfer_require=args.transfer_require)
        print(f"starting {args.topology} ({dep.model.name}); sampling {args.seconds:g} s once ready",
              file=sys.stderr, flush=True)
        with dep:
            rep = {"topology": args.topology, "window_s": args.seconds,
                   **deployment_idle_cpu(dep, args.seconds, args.settle)}
    except (BenchError, StartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if args.json else format_idle(rep))
    return 0
