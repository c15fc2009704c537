"""`triptych simulate`, `triptych plan` and `triptych workload` (argument declarations live
in triptych/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys

from triptych.error_text import short_error
from triptych.operator.planner.model_shape import read_shape
from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.roofline import roofline_profile
from triptych.operator.planner.simulator import SimConfig, goodput, simulate
from triptych.operator.planner.workload import (
    Dist,
    TraceRequest,
    WorkloadSpec,
    at_rate,
    generate,
    read_trace,
    stats,
    write_trace,
)
from triptych.topology import parse_topology


def load_profile(args: argparse.Namespace) -> StepProfile:
    if args.profile:
        return StepProfile.load(args.profile)
    if not args.model:
        raise SystemExit("--model DIR (its config.json) is needed with --gpu")
    return roofline_profile(read_shape(args.model), args.gpu)


def _dist(median: int, sigma: float, high: int) -> Dist:
    if sigma <= 0:
        return Dist(kind="fixed", value=median)
    return Dist(kind="lognormal", median=median, sigma=sigma, low=1, high=high)


def spec_from_args(args: argparse.Namespace, rate: float | None = None) -> WorkloadSpec:
    rate = rate if rate is not None else args.rate if args.rate is not None else 1.0
    return WorkloadSpec(
        rate=rate, num_requests=args.num_requests,
        images_per_request=Dist(kind="fixed", value=args.images_per_request), image_size=tuple(args.image_size),
        prompt_tokens=_dist(args.prompt_tokens, args.prompt_sigma, args.max_tokens),
        output_tokens=_dist(args.output_tokens, args.output_sigma, args.max_tokens), seed=args.seed)


def load_workload(args: argparse.Namespace) -> list[TraceRequest]:
    if args.workload:
        trace = read_trace(args.workload)
        return at_rate(trace, args.rate) if args.rate is not None else trace
    return generate(spec_from_args(args))


def sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(ttft_slo_s=args.slo_ttft, tbt_slo_s=args.slo_tbt, routing=args.routing)


def load_inputs(args: argparse.Namespace, command: str) -> tuple[StepProfile, list[TraceRequest], SimConfig]:
    """The profile, workload and SLOs a command runs on. A file that cannot be read, or does
    not hold what it should, is a one-line error naming it (exit 1), not a traceback."""
    try:
        return load_profile(args), load_workload(args), sim_config(args)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"triptych {command}: {short_error(exc)}") from None


def workload_main(args: argparse.Namespace) -> int:
    try:
        trace = generate(spec_from_args(args))
        write_trace(args.out, trace)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"triptych workload: {short_error(exc)}") from None
    print(stats(trace).model_dump_json())
    return 0


def simulate_main(args: argparse.Namespace) -> int:
    topology = parse_topology(args.topology)  # checked by argparse already (cli_args.topology)
    profile, trace, cfg = load_inputs(args, "simulate")
    reports = []
    for rate in args.rates or [None]:
        run = at_rate(trace, rate) if rate else trace
        reports.append(simulate(topology, profile, run, cfg).model_dump())
    out: dict[str, object] = {"profile": profile.source, "workload": stats(trace).model_dump(), "runs": reports}
    if args.goodput:
        from triptych.operator.planner.capacity import stage_costs

        bound = stage_costs(profile, stats(trace), cfg.ttft_slo_s, cfg.tbt_slo_s).bound(topology)
        out["goodput"] = goodput(topology, profile, trace, cfg, bound,
                                 max_requests=args.max_sim_requests or None).model_dump()
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    for r in reports:
        print(f"{args.topology} rate {r['rate']:.2f}: attainment {r['slo_attainment'] * 100:.1f}%  "
              f"TTFT p50/p90/p99 {_s(r['ttft_p50_s'])}/{_s(r['ttft_p90_s'])}/{_s(r['ttft_p99_s'])} s  "
              f"TPOT p50/p90/p99 {_ms(r['tpot_p50_s'])}/{_ms(r['tpot_p90_s'])}/{_ms(r['tpot_p99_s'])} ms  "
              f"{'sustained' if r['sustained'] else 'queues grow'}")
    if args.goodput:
        print(f"goodput {out['goodput']['goodput_rps']:.2f} req/s")  # type: ignore[index]
    return 0


def plan_main(args: argparse.Namespace) -> int:
    from triptych.operator.planner.optimizer import PlanConfig, plan

    profile, trace, cfg = load_inputs(args, "plan")
    pcfg = PlanConfig(keep_per_method=args.keep_per_method, max_requests=args.max_sim_requests or None,
                      **({"methods": args.methods} if args.methods else {}))
    result = plan(profile, trace, args.instances, cfg, pcfg)
    if args.json:
        print(result.model_dump_json(indent=1))
        return 0
    print(f"best: {result.method} {result.topology}  goodput {result.predicted_goodput_rps:.2f} req/s  "
          f"attainment at {result.workload.rate:.2f} req/s: {result.predicted_attainment * 100:.1f}%  "
          f"({result.simulated} simulated of {result.searched} ratios, {result.elapsed_s:.1f} s)")
    for c in result.ranking:
        g = f"{c.goodput_rps:.2f}" if c.goodput_rps is not None else "-"
        print(f"  {c.method:6s} {c.topology:18s} bound {c.bound_rps:9.2f}  goodput {g}")
    return 0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"
