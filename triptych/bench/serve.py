"""`triptych bench serve`: the command. Load against a running router (`--url`), or the
same load against several local deployments (`--topologies`); text, JSON and a plot.
This module and what it imports at start-up are torch-free (a client)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from triptych.bench.errors import BenchError
from triptych.bench.loadgen import RunConfig, run_bench
from triptych.bench.nixl_bandwidth import measure_nixl
from triptych.bench.report import TOPOLOGY_COLUMNS, fmt, format_report, plot_attainment, progress, table
from triptych.bench.stats import SLO
from triptych.bench.topologies import run_topologies
from triptych.bench.trace import load_trace, trace_rate
from triptych.bench.workload import Workload
from triptych.worker.auth import ADMIN_TOKEN_ENV


def _config(args: argparse.Namespace) -> RunConfig:
    trace = load_trace(args.trace) if getattr(args, "trace", None) else None
    rates = list(args.rates)
    if trace is not None:  # the trace's own timing unless --trace-rates re-times it
        rates = list(getattr(args, "trace_rates", None) or [trace_rate(trace)])
    return RunConfig(
        work=Workload(num_requests=args.num_requests, images_per_request=args.images_per_request,
                      image_size=tuple(args.image_size), prompt_len=args.prompt_len,  # type: ignore[arg-type]
                      output_len=args.output_len),
        slo=SLO(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo, target=getattr(args, "attainment_target", 0.9)),
        rates=rates, trace=trace, sweep=getattr(args, "sweep", False),
        sweep_max_rate=getattr(args, "sweep_max_rate", 64.0), sweep_steps=getattr(args, "sweep_steps", 2),
        seed=args.seed, timeout_s=getattr(args, "request_timeout", 120.0), warmup=getattr(args, "warmup", 1))


def _write_outputs(args: argparse.Namespace, result: dict[str, Any], series: dict[str, Any], text: str,
                   target: float) -> None:
    if getattr(args, "plot", None):
        plot_attainment(series, Path(args.plot), target)
        progress(f"wrote {args.plot}")
    if getattr(args, "out_json", None):
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
        progress(f"wrote {args.out_json}")
    print(json.dumps(result, indent=2) if args.json else text)


def cli_main(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
        cfg.check()
        topologies = [t for t in (getattr(args, "topologies", None) or "").split(",") if t.strip()]
        if bool(topologies) == bool(args.url):
            raise BenchError("give either --url (a running router) or --topologies (start each locally)")
        headers = {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else {}
        instance_cpus, total_cpus = getattr(args, "instance_cpus", None), getattr(args, "total_cpus", None)
        quotas = instance_cpus is not None or total_cpus is not None
        if quotas and not topologies:
            raise BenchError("--instance-cpus/--total-cpus cap the instances --topologies starts")
        note = ""
        if topologies:
            log_dir = Path(args.log_dir) if getattr(args, "log_dir", None) else None
            per = run_topologies([t.strip() for t in topologies], args.model, cfg,
                                 getattr(args, "transfer_require", "nixl"), log_dir,
                                 getattr(args, "idle_seconds", 3.0), instance_cpus, total_cpus,
                                 dtype=getattr(args, "dtype", "float32"))
            result: dict[str, Any] = {"topologies": per}
            series = {spec: [(r["rate"], r["slo_attainment"]) for r in rep["rates"]] for spec, rep in per.items()}
            rows = [{"topology": spec, **rep} for spec, rep in per.items()]
            columns = TOPOLOGY_COLUMNS
            if quotas:
                columns = (*columns, ("cpu/inst", "instance_cpus", 1, 3), ("cpuTotal", "total_cpus", 1, 2))
                note = ("\n\ncpu/inst: CPU quota of each instance (-: none could be set); the router is "
                        "uncapped. A quota is a ceiling: on a busy machine an instance may get less.")
            text = table(rows, columns, label=("topology", "topology"))
        else:
            # The admin token (TRIPTYCH_ADMIN_TOKEN) lets the report read exact timings.
            admin = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
            result = asyncio.run(run_bench(args.url, cfg, getattr(args, "worker_urls", None) or [], headers,
                                           {"Authorization": f"Bearer {admin}"} if admin else None))
            series = {"attainment": [(r["rate"], r["slo_attainment"]) for r in result["rates"]]}
            text = ""
        if getattr(args, "measure_nixl", False):
            result.update(measure_nixl(getattr(args, "nixl_mib", 64)))
        text += note
        if not topologies:
            text = format_report(result)
        elif "nixl_read_gib_s" in result:
            text += (f"\n\nraw NIXL READ bandwidth: {fmt(result['nixl_read_gib_s'], 1, 2)} GiB/s "
                     f"({result.get('nixl_read_error') or str(result['nixl_read_mib']) + ' MiB reads'})")
        _write_outputs(args, result, series, text, cfg.slo.target)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
