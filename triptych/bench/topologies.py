"""The same request plan against several local deployments (`bench serve --topologies`),
one after the other, each with its idle CPU measured before the load.

Capacity: with `--instance-cpus X` every instance of every topology is capped at X CPUs
(triptych.cpu_quota); with `--total-cpus T` each topology gets the same total, split evenly
over its instances (T / number of instances: EPD 1 x T, 1EP1D 2 x T/2, 1E1P1D 3 x T/3),
so that topologies are compared at equal capacity. The router is never capped: it is the
same front door in every topology."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from triptych.bench.errors import BenchError
from triptych.bench.idle_cpu import deployment_idle_cpu
from triptych.bench.loadgen import RunConfig, run_bench
from triptych.bench.report import progress

IDLE_SETTLE_S = 1.0  # after /ready, before the idle window: start-up work dies down


def cpus_per_instance(instances: int, instance_cpus: float | None, total_cpus: float | None) -> float | None:
    """The quota of each instance of a topology with `instances` instances (None: no quota)."""
    if instance_cpus is not None and total_cpus is not None:
        raise BenchError("give --instance-cpus or --total-cpus, not both")
    for name, value in (("--instance-cpus", instance_cpus), ("--total-cpus", total_cpus)):
        if value is not None and not 0 < value < float("inf"):
            raise BenchError(f"{name} must be a positive number of CPUs, got {value}")
    if total_cpus is not None:
        return total_cpus / instances
    return instance_cpus


def run_topologies(specs: Sequence[str], model: str, cfg: RunConfig, transfer_require: str,
                   log_dir: Path | None, idle_s: float = 3.0, instance_cpus: float | None = None,
                   total_cpus: float | None = None, dtype: str = "float32") -> dict[str, Any]:
    """Start each topology with LocalDeployment, measure its idle CPU for `idle_s` (0: skip),
    run the same plan against it, stop it."""
    from triptych.cli_args import resolve_model
    from triptych.local import LocalDeployment
    from triptych.topology import TopologyError, parse_topology

    try:
        parsed = {spec: parse_topology(spec) for spec in specs}
    except TopologyError as exc:
        raise BenchError(str(exc)) from exc
    if idle_s < 0:
        raise BenchError(f"--idle-seconds must be >= 0, got {idle_s}")
    cpus = {spec: cpus_per_instance(sum(t.values()), instance_cpus, total_cpus) for spec, t in parsed.items()}
    model_dir = resolve_model(model)
    out: dict[str, Any] = {}
    for spec, topology in parsed.items():
        quota = f", {cpus[spec]:.3g} CPUs per instance" if cpus[spec] else ""
        progress(f"== {spec}: starting local deployment of {model_dir.name}{quota}")
        dep = LocalDeployment(model=model_dir, topology=topology, transfer_require=transfer_require,
                              log_dir=log_dir / spec if log_dir else None, instance_cpus=cpus[spec],
                              dtype=dtype)
        with dep:
            quotas = dep.instance_quotas()
            idle = deployment_idle_cpu(dep, idle_s, IDLE_SETTLE_S) if idle_s else None
            if idle:
                progress(f"idle CPU: {idle['idle_cpu_cores']:.3f} cores (most any one process used over {idle_s:g} s)")
            out[spec] = asyncio.run(run_bench(dep.router_url, cfg, [w.url for w in dep.workers],
                                              admin_headers=dep.admin_headers))
            if cpus[spec] is not None:
                capped = dep.quota is not None
                out[spec].update(instance_cpus=cpus[spec] if capped else None, cpu_quota=quotas,
                                 total_cpus=cpus[spec] * len(quotas) if capped else None,
                                 cpu_quota_error=dep.quota_error)
            if idle:
                out[spec]["idle_cpu_cores"] = idle["idle_cpu_cores"]
                out[spec]["idle_cpu"] = idle["processes"]
    return out
