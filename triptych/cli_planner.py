"""The offline planner's subcommands: `triptych simulate`, `plan`, `workload`, and `profile`
(the step-time tables they read). Arguments only; the work lives in operator/planner/cli.py
and worker/step_profile.py."""

from __future__ import annotations

import argparse

from triptych.cli_args import (
    add_device,
    add_dtype,
    add_gpu,
    add_json,
    add_model,
    add_planner_slos,
    add_request_shape,
    add_seed,
    add_threads,
    count,
    cpus,
    lazy,
    rate,
    topology,
)

# `plan`'s and `simulate --goodput`'s bound on one simulated run (the live replanner's is
# 2,000): 1,000 instances of a small model on an H100 roofline plan in 6 s instead of 9
# minutes, to the same choice.
MAX_SIM_REQUESTS = 10_000


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """A synthetic workload (planner/workload.py): Poisson arrivals, lognormal lengths."""
    p.add_argument("--rate", type=rate, default=None, help="requests/s (re-times a --workload trace)")
    add_request_shape(p, 500, [448, 448], ("W", "H"))
    p.add_argument("--prompt-tokens", type=int, default=64, help="median text tokens")
    p.add_argument("--prompt-sigma", type=float, default=0.0, help="lognormal sigma (0: fixed)")
    p.add_argument("--output-tokens", type=int, default=64, help="median output tokens")
    p.add_argument("--output-sigma", type=float, default=0.0, help="lognormal sigma (0: fixed)")
    p.add_argument("--max-tokens", type=int, default=8192, help="clip sampled lengths here")
    add_seed(p)


def _add_planner_common(p: argparse.ArgumentParser) -> None:
    add_model(p, None, "model directory (only its config.json is read)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", default=None, help="step-time profile JSON (triptych profile)")
    add_gpu(src, "roofline stand-in for a measured profile")
    p.add_argument("--workload", default=None, help="JSON-lines trace (else a synthetic workload)")
    add_planner_slos(p, "seconds")
    p.add_argument("--routing", choices=("round-robin", "least-loaded"), default="round-robin")
    add_json(p)
    _add_workload_args(p)


def _add_sim_cap(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-sim-requests", type=int, default=MAX_SIM_REQUESTS, metavar="N",
                   help="arrivals per goodput-search run at most (0: no cap; else each run holds 15-30 s "
                        "of arrivals, which for a small model on a large GPU is hundreds of thousands)")


def add_planner(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="simulate a topology under a workload (discrete-event)")
    _add_planner_common(s)
    s.add_argument("--topology", type=topology, required=True, help="e.g. 1E1P1D, 2EP1D, EPD")
    s.add_argument("--rates", type=rate, nargs="*", default=[], help="run the workload at each rate")
    s.add_argument("--goodput", action="store_true", help="also search the goodput")
    _add_sim_cap(s)
    s.set_defaults(func=lazy("triptych.operator.planner.cli:simulate_main"))
    p = sub.add_parser("plan", help="best hybrid method and instance ratio for N instances (simulated)")
    _add_planner_common(p)
    p.add_argument("--instances", type=count, required=True)
    p.add_argument("--methods", nargs="*", default=None, help="subset of E+P+D EP+D ED+P E+PD EPD")
    p.add_argument("--keep-per-method", type=int, default=2, help="ratios per method simulated")
    _add_sim_cap(p)
    p.set_defaults(func=lazy("triptych.operator.planner.cli:plan_main"))
    w = sub.add_parser("workload", help="write a synthetic JSON-lines workload trace")
    w.add_argument("--out", required=True)
    _add_workload_args(w)
    w.set_defaults(func=lazy("triptych.operator.planner.cli:workload_main"))


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure step-time tables on this device (for simulate/plan)")
    add_model(p, None, required=True)
    p.add_argument("--out", required=True, help="profile JSON")
    add_device(p)
    add_dtype(p)
    add_threads(p)
    p.add_argument("--migration-bytes-per-s", type=float, default=None,
                   help="measured transfer bandwidth (default: an in-memory copy here)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024], help="prefill sizes")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="decode batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 256, 1024], help="decode context lengths")
    p.add_argument("--cpu-share", type=cpus, default=None, metavar="X",
                   help="the steps of an instance capped at X CPUs (serve --instance-cpus X), measured "
                        "uncapped: this process's CPU seconds per step divided by X (--device cpu)")
    p.set_defaults(func=lazy("triptych.worker.step_profile:cli_main"))
