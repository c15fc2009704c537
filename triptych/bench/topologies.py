"""The same request plan against several local deployments (`bench serve --topologies`),
one after the other, each with its idle CPU measured before the load."""

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


def run_topologies(specs: Sequence[str], model: str, cfg: RunConfig, transfer_require: str,
                   log_dir: Path | None, idle_s: float = 3.0) -> dict[str, Any]:
    """Start each topology with LocalDeployment, measure its idle CPU for `idle_s` (0: skip),
    run the same plan against it, stop it."""
    from triptych.local import LocalDeployment, resolve_model
    from triptych.topology import TopologyError, parse_topology

    try:
        parsed = {spec: parse_topology(spec) for spec in specs}
    except TopologyError as exc:
        raise BenchError(str(exc)) from exc
    if idle_s < 0:
        raise BenchError(f"--idle-seconds must be >= 0, got {idle_s}")
    model_dir = resolve_model(model)
    out: dict[str, Any] = {}
    for spec, topology in parsed.items():
        progress(f"== {spec}: starting local deployment of {model_dir.name}")
        dep = LocalDeployment(model=model_dir, topology=topology, transfer_require=transfer_require,
                              log_dir=log_dir / spec if log_dir else None)
        with dep:
            idle = deployment_idle_cpu(dep, idle_s, IDLE_SETTLE_S) if idle_s else None
            if idle:
                progress(f"idle CPU: {idle['idle_cpu_cores']:.3f} cores (most any one process used over {idle_s:g} s)")
            out[spec] = asyncio.run(run_bench(dep.router_url, cfg, [w.url for w in dep.workers]))
            if idle:
                out[spec]["idle_cpu_cores"] = idle["idle_cpu_cores"]
                out[spec]["idle_cpu"] = idle["processes"]
    return out
