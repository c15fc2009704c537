"""Which CPUs each local process runs on: every engine its own cores, the rest on the others.

An engine step is a chain of short native ops (GEMMs, the decode kernel) with Python
between them. Where the router, the client and the workers' event loops share the
engine's cores, the kernel's scheduler puts them on the engine's core now and then and the
engine waits in the run queue, and an engine's OpenMP threads can land on another
engine's cores. vLLM's CPU backend binds its OpenMP threads to cores and keeps a core for
its API server for these reasons (`VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_NUM_OF_RESERVED_CPU`).
`triptych serve --cpu-binding auto` does the same (opt-in: on the 2-core machine these
were measured on it did not serve more, docs/benchmarks.md "Binding the engine to a core").

`plan` gives each instance `threads` CPUs of its own for its engine thread (and the
OpenMP threads that thread starts) and leaves the rest to the *service* side: the router,
the planner and each worker's other threads (event loop, image decode pool, transfers).
It binds only when every instance gets its own cores and at least one is left over;
otherwise it says why (`BindingUnavailable`) and the caller runs unbound. Threads
inherit their creator's CPUs (`sched_setaffinity` on Linux binds the calling thread), so a
worker binds its main thread to the service CPUs first (`worker/launch.py`) and its
engine thread rebinds itself when it starts (`worker/engine/driver.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class BindingUnavailable(RuntimeError):
    """No binding fits this machine; the message says why."""


@dataclass(frozen=True)
class CpuBinding:
    service: tuple[int, ...]  # the router, the planner, the workers' event loops and pools
    engines: dict[str, tuple[int, ...]]  # instance name -> its engine thread's CPUs

    def describe(self) -> str:
        engines = "; ".join(f"{name} on CPU {format_cpu_list(cpus)}" for name, cpus in self.engines.items())
        return f"engines: {engines}; router and service threads on CPU {format_cpu_list(self.service)}"


def plan(cpus: Sequence[int], names: Sequence[str], threads: int) -> CpuBinding:
    """Each of `names` gets `threads` of `cpus` (the last ones, in order), the rest serve.
    Raises BindingUnavailable when they do not fit with one CPU left over."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    cpus = sorted(set(cpus))
    need = len(names) * threads
    if need + 1 > len(cpus):
        raise BindingUnavailable(f"{len(names)} instance(s) x {threads} thread(s) and a CPU for the router "
                                 f"need {need + 1} CPUs; this process may use {len(cpus)}")
    service = len(cpus) - need
    engines = {name: tuple(cpus[service + i * threads: service + (i + 1) * threads]) for i, name in enumerate(names)}
    return CpuBinding(service=tuple(cpus[:service]), engines=engines)


def available_cpus() -> list[int]:
    """The CPUs this process may run on (a container's cpuset, taskset), sorted."""
    return sorted(os.sched_getaffinity(0))


def bind_current_thread(cpus: Iterable[int]) -> None:
    """Run the calling thread (and the threads it creates from now on) on `cpus` only."""
    os.sched_setaffinity(0, set(cpus))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3,8,10-11", as in /proc/*/status Cpus_allowed_list) as CPUs."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-3,8)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        out.update(range(first, last + 1))
    return tuple(sorted(out))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of parse_cpu_list: runs of consecutive CPUs as ranges."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
