"""`triptych bench simulate-validate`: the simulator against measured runs of the same
workload on this machine (issue 11: TTFT and TPOT p50 / p90, error in %).

1. A step-time profile of the model measured here (`triptych profile`) with the instances'
   threads, at their CPU share (`--cpu-share X`: CPU seconds per step over X), or
   `--profile FILE`.
2. One synthetic trace (Poisson arrivals, fixed shapes), re-timed to each rate.
3. Per topology: a capacity-faithful local deployment (`--instance-cpus X`: every
   instance capped at X CPUs, triptych/cpu_quota.py) replays the trace at each rate
   (`bench serve --trace`); the simulator runs the same trace on the same topology with
   the measured profile. The prompt the simulator sees includes the chat template's
   tokens (measured by the replay's calibration).
4. A table: measured vs simulated TTFT / TPOT p50 and p90 and the error
   (simulated - measured) / measured in %, with the load average of the machine.

The profile times the engine's steps alone; a served request also pays for HTTP hops
(client -> router -> instances, SSE back), the worker's driver loop and streaming. With
`--fit-overheads` (the default) these fixed costs are measured per topology from a lone
request before the load (thirty warm-ups, five idle seconds, fifteen timed; no queueing;
`sim_calibration.py`): a cost per decoding request per step
(`StepProfile.decode_token_overhead_s`) so the simulated TPOT of that request matches,
busy time per request per instance type from the instances' CPU, less what they burn idle
(`SimConfig.request_work_s`), then a per-request TTFT overhead (`SimConfig.ttft_overhead_s`).
With `--lone-noise` (the default) each simulated request then gets, in turn, one lone
request's spread around their median (`SimConfig.ttft_noise_s`, `tpot_noise`): the
simulator's steps are deterministic, so without it a light load's p90 equals its p50,
while a capped instance's requests land at any phase of the quota's period (a 1EP1D
deployment at 0.25 CPU and a 10 ms period: TTFTs 23-71 ms at 1.5 req/s; with the kernel's
100 ms period, where a request's work fits in one period's budget, 14-21 ms). What the loaded runs then
validate is the simulator's batching and queueing. `--no-fit-overheads` compares the
raw profile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from triptych.bench.errors import BenchError
from triptych.bench.loadgen import RunConfig, run_bench
from triptych.bench.report import fmt, progress
from triptych.bench.sim_calibration import Calibration, calibrate_requests, pooled
from triptych.bench.stats import SLO
from triptych.bench.trace import timed
from triptych.bench.workload import Workload
from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.simulator import SimConfig, simulate
from triptych.operator.planner.workload import TraceRequest, WorkloadSpec, fixed, generate
from triptych.topology import InstanceType, Stage, parse_topology

METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


def measure_profile(model_dir: Path, out: Path, cpus: float | None) -> StepProfile:
    """`triptych profile` in a subprocess with the instances' threads. For instances capped
    at `cpus` CPUs, `--cpu-share cpus`: CPU seconds per step over the share, the quota's
    average rate (profiled inside the quota, steps of a few ms land on either side of a
    period's stall; worker/step_profile.py)."""
    from triptych.cpu_quota import threads_for

    threads = threads_for(cpus) if cpus else 1
    cmd = [sys.executable, "-m", "triptych.cli", "profile", "--model", str(model_dir), "--out", str(out),
           "--threads", str(threads), "--contexts", "32", "256", "--batches", "1", "4", "16"]
    if cpus:
        cmd += ["--cpu-share", str(cpus)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL)
    except (subprocess.SubprocessError, OSError) as exc:
        raise BenchError(f"triptych profile failed: {exc}") from exc
    return StepProfile.load(out)


def make_trace(args: argparse.Namespace) -> list[TraceRequest]:
    spec = WorkloadSpec(rate=1.0, num_requests=args.num_requests, images_per_request=fixed(args.images_per_request),
                        image_size=tuple(args.image_size), prompt_tokens=fixed(args.prompt_tokens),
                        output_tokens=fixed(args.output_tokens), seed=args.seed)
    return generate(spec)


def with_template(trace: list[TraceRequest], template_tokens: int) -> list[TraceRequest]:
    return [r.model_copy(update={"prompt_tokens": r.prompt_tokens + template_tokens}) for r in trace]


def error_pct(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real <= 0:
        return None
    return 100.0 * (sim - real) / real


@dataclass
class Fitted:
    profile: StepProfile
    cfg: SimConfig

    def describe(self) -> str:
        return (f"step overhead {self.profile.step_overhead_s * 1e3:.2f} ms, token overhead "
                f"{self.profile.decode_token_overhead_s * 1e3:.2f} ms, request work "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.cfg.request_work_s.items())
                + f" ms per request, TTFT overhead "
                f"{self.cfg.ttft_overhead_s * 1e3:.1f} ms")


def _tpot(topology: dict[InstanceType, int], profile: StepProfile, trace: list[TraceRequest],
          cfg: SimConfig) -> float:
    return simulate(topology, profile, trace, cfg).tpot_p50_s or 0.0


def fit_step_costs(topology: dict[InstanceType, int], profile: StepProfile, lone: list[TraceRequest],
                   burst: list[TraceRequest], cfg: SimConfig, tpot: float, burst_tpot: float,
                   rounds: int = 6) -> StepProfile:
    """The served path's cost per decode step (`step_overhead_s`: the driver loop, the
    step's batched output event, which a batch shares) and per decoding request per step
    (`decode_token_overhead_s`: its token's processing and streaming) such that the
    simulated TPOT of a lone request and of a burst of identical requests match the
    measured ones. Simulated TPOT is nearly linear in both: Newton steps on finite
    differences solve the 2x2 system; a share that would go negative is clamped to 0."""
    d = 1e-3

    def with_costs(step: float, token: float) -> StepProfile:
        return profile.model_copy(update={"step_overhead_s": max(0.0, step), "decode_token_overhead_s": max(0.0, token)})

    def both(p: StepProfile) -> tuple[float, float]:
        return _tpot(topology, p, lone, cfg), _tpot(topology, p, burst, cfg)

    s0, t0 = profile.step_overhead_s, profile.decode_token_overhead_s
    for _ in range(rounds):
        f0 = both(with_costs(s0, t0))
        r1, r2 = tpot - f0[0], burst_tpot - f0[1]
        if abs(r1) <= 1e-3 * tpot and abs(r2) <= 1e-3 * burst_tpot:
            break
        fs, ft = both(with_costs(s0 + d, t0)), both(with_costs(s0, t0 + d))
        a, b = (fs[0] - f0[0]) / d, (ft[0] - f0[0]) / d  # d lone / d step, d lone / d token
        c, e = (fs[1] - f0[1]) / d, (ft[1] - f0[1]) / d  # the same for the burst
        det = a * e - b * c
        ds, dt = ((r1 * e - b * r2) / det, (a * r2 - c * r1) / det) if abs(det) > 1e-9 else (0.0, r1 / b if b else 0.0)
        if s0 + ds < 0:  # the burst is slower than per-request costs explain: all of it per request
            s0, t0 = 0.0, max(0.0, t0 + (r1 + a * s0) / b) if b else t0
        elif t0 + dt < 0:  # the burst is faster than per-step costs explain: all of it per step
            s0, t0 = max(0.0, s0 + (r1 + b * t0) / a) if a else s0, 0.0
        else:
            s0, t0 = s0 + ds, t0 + dt
    return with_costs(s0, t0)


def fit_overheads(topology: dict[InstanceType, int], profile: StepProfile, lone: list[TraceRequest],
                  cfg: SimConfig, cal: Calibration, fit_request_work: bool = True,
                  instance_cpus: float | None = None) -> Fitted:
    """The fixed costs the profile does not see, from the calibration requests (no queueing):

    1. a cost per decode step and one per decoding request per step (`fit_step_costs`), so
       the simulated TPOT of a lone request and of a burst match;
    2. with `fit_request_work`: what the CPU seconds per lone request of each instance type
       do not account for in its steps is request work that keeps the instance busy (its
       stage run's HTTP, image decode, transfers); at a quota of X < 1 CPU it takes 1/X as
       long in wall time;
    3. a TTFT overhead for what is left of the lone request's TTFT: the router and the
       hops' latency, which use no instance's capacity (negative, down to minus the
       encoding and prefilling types' request work, where that work partly follows their
       hand-off)."""
    from triptych.operator.planner.simulator import Simulation

    fitted = profile
    burst = [lone[0].model_copy(update={"t": 0.0}) for _ in range(cal.burst)]
    slow = 1.0 / min(1.0, instance_cpus) if instance_cpus else 1.0
    first = True
    for _ in range(8):  # the fits feed each other (request work lengthens a step); a few rounds settle
        fitted = fit_step_costs(topology, fitted, lone, burst, cfg, cal.tpot_s, cal.burst_tpot_s)
        if not fit_request_work:
            break
        sim = Simulation(topology, fitted, cfg)
        sim.run(lone)
        busy: dict[str, float] = {}
        for inst in sim.instances:  # steps and request work so far
            busy[inst.kind.value] = busy.get(inst.kind.value, 0.0) + inst.busy_time
        # The profile was measured at the quota, so busy time is wall time at X CPUs, and
        # the CPU seconds take 1/X as long there. Request work makes up the difference,
        # updated rather than recomputed, so the fits settle where both the TPOT and the
        # busy time match. A type that decodes is the exception: its busy time is pinned
        # by the TPOT fit (request work there only displaces step costs), so its request
        # work is what the first round leaves over, then fixed.
        work = {kind: max(0.0, cfg.request_work_s.get(kind, 0.0) + cpu * slow - busy.get(kind, 0.0))
                if first or not InstanceType(kind).runs(Stage.DECODE) else cfg.request_work_s.get(kind, 0.0)
                for kind, cpu in cal.cpu_s.items()}
        cfg = cfg.model_copy(update={"request_work_s": work})
        first = False
    again = simulate(topology, fitted, lone, cfg)
    # Negative when the lone request's first token came sooner than its request work
    # charged up front allows: some of a prefilling instance's work per request (serving
    # the KV pull) comes after the first token, and some of an encoding instance's (its
    # stage run's events and lease release) after its hand-off. At most that work.
    after = sum(w for kind, w in cfg.request_work_s.items()
                if InstanceType(kind).runs(Stage.PREFILL) or InstanceType(kind).runs(Stage.ENCODE))
    overhead = max(-after, cal.ttft_s - (again.ttft_p50_s or 0.0))
    return Fitted(fitted, cfg.model_copy(update={"ttft_overhead_s": overhead}))


def _span(xs: list[float], scale: float = 1.0, unit: str = "") -> str:
    return f"{min(xs) * scale:+.2f}..{max(xs) * scale:+.2f}{unit}" if xs else "-"


@dataclass
class MeasuredRun:
    """One deployment of a topology: its calibration and the trace replayed at each rate."""

    cal: Calibration
    rates: list[dict[str, Any]]  # run_bench's report per rate, in the order of --rates
    load_avg_1m: float
    budgets: dict[str, tuple[int, int]] = field(default_factory=dict)  # served_budgets


def measured_cells(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate's reports from several deployments as one row's measured part: each metric's
    median over the runs, the runs' values, and how far apart they are (max - min over the
    median, in %): the measurement's own repeatability, a floor under any simulator's error."""
    row: dict[str, Any] = {"completed": sum(r["completed"] for r in reports),
                           "num_requests": sum(r["num_requests"] for r in reports), "runs": len(reports)}
    for m in METRICS:
        values = [r.get(m) for r in reports]
        known = [v for v in values if v is not None]
        mid = statistics.median(known) if known else None
        row[f"measured_{m}"], row[f"measured_{m}_runs"] = mid, values
        row[f"repeat_spread_{m}"] = (100.0 * (max(known) - min(known)) / mid
                                     if len(known) > 1 and mid else None)
    return row


def measure_topology(spec: str, topology: dict[InstanceType, int], model_dir: Path, trace: list[TraceRequest],
                     args: argparse.Namespace, run: int) -> MeasuredRun:
    """A fresh capacity-faithful deployment: calibrate, then replay the trace at each rate."""
    from triptych.local import LocalDeployment

    log_dir = Path(args.log_dir) / (spec if run == 0 else f"{spec}.{run}") if args.log_dir else None
    dep = LocalDeployment(model=model_dir, topology=topology, transfer_require=args.transfer_require,
                          instance_cpus=args.instance_cpus, cpu_priority=args.priority,
                          cpu_period_ms=args.instance_cpu_period_ms, log_dir=log_dir)
    with dep:
        if args.instance_cpus and dep.quota is None:
            progress(f"warning: {spec} runs WITHOUT CPU quotas ({dep.quota_error})")
        pids: dict[str, list[int]] = {}
        for w in dep.workers:  # worker-<type>-<index>
            pids.setdefault(w.name.split("-")[1], []).append(w.popen.pid)
        budgets = served_budgets(dep)
        cal = asyncio.run(calibrate_requests(dep.router_url, trace, pids, lone_timed=args.calibration_requests,
                                             warmups=args.calibration_warmups))
        cpu_text = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in cal.cpu_s.items()) + " ms (less idle: " + \
            ", ".join(f"{k} {v:.3f}" for k, v in cal.idle_cores.items()) + " cores)"
        progress(f"== {spec} (run {run + 1}): lone TTFT {cal.ttft_s * 1e3:.1f} ms, TPOT {cal.tpot_s * 1e3:.2f} ms, "
                 f"burst of {cal.burst} TPOT {cal.burst_tpot_s * 1e3:.2f} ms, instance CPU {cpu_text}, template "
                 f"{cal.template_tokens} tokens; lone TTFT {_span(cal.ttft_noise_s, 1e3, ' ms')} around the "
                 f"median, TPOT x{_span(cal.tpot_noise)}")
        cfg = RunConfig(work=Workload(), slo=SLO(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo), rates=list(args.rates),
                        seed=args.seed, timeout_s=args.request_timeout, warmup=0, trace=trace)
        load_before = os.getloadavg()[0]
        measured = asyncio.run(run_bench(dep.router_url, cfg, [w.url for w in dep.workers]))
        load_after = os.getloadavg()[0]
    return MeasuredRun(cal, measured["rates"], round(max(load_before, load_after), 2), budgets)


def served_budgets(dep: Any) -> dict[str, tuple[int, int]]:
    """The (token, image) budgets each instance type's workers run with, as their
    `/admin/stats` say: the simulator batches as they do (without SLOs a worker runs the
    engine's defaults, not what the simulator would derive from the bench's SLO)."""
    out: dict[str, tuple[int, int]] = {}
    for w in dep.workers:  # worker-<type>-<index>
        stats = httpx.get(f"{w.url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        out.setdefault(w.name.split("-")[1], (int(stats["token_budget"]), int(stats["image_budget"])))
    return out


def fit_for(topology: dict[InstanceType, int], profile: StepProfile, trace: list[TraceRequest],
            cal: Calibration, args: argparse.Namespace, budgets: dict[str, tuple[int, int]] | None = None) -> Fitted:
    """The simulator fitted to one calibration (`--fit-overheads`, then `--lone-noise`),
    its instances batching under `budgets` (served_budgets) where given."""
    fit = Fitted(profile, SimConfig(ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                                    instance_budgets=budgets or {}, request_work_beside=args.request_work_beside))
    if args.fit_overheads:
        fit = fit_overheads(topology, profile, with_template(trace, cal.template_tokens)[:1], fit.cfg, cal,
                            args.fit_request_work, args.instance_cpus)
        if args.lone_noise:  # after the fit, which matches the lone requests' medians
            fit = Fitted(fit.profile, fit.cfg.model_copy(update=cal.noise()))
    return fit


def run_topology(spec: str, topology: dict[InstanceType, int], model_dir: Path, profile: StepProfile,
                 trace: list[TraceRequest], args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--repeats` deployments of the topology measured; the simulator fitted once to their
    pooled calibration; per rate, the measured medians against the simulation. (Fitting each
    deployment to its own calibration and comparing it with that deployment was tried on
    the same measurements, `calibrations` in the JSON: no closer, 17.9% against 17.6% and
    11.7% against 12.5% mean |error| over two runs.)"""
    runs = [measure_topology(spec, topology, model_dir, trace, args, k) for k in range(args.repeats)]
    return compare(spec, topology, profile, trace, runs, args)


def compare(spec: str, topology: dict[InstanceType, int], profile: StepProfile, trace: list[TraceRequest],
            runs: list[MeasuredRun], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one topology: the simulator fitted to the runs' pooled calibration against
    their measured medians at each rate."""
    cal = pooled([r.cal for r in runs])
    fit = fit_for(topology, profile, trace, cal, args, runs[0].budgets)
    progress(f"== {spec}: fitted {fit.describe()}; budgets (tokens, images) {runs[0].budgets}")
    sim_trace = with_template(trace, cal.template_tokens)
    burst_ttft = simulated_burst_ttft(topology, fit, sim_trace[0], cal.burst)
    progress(f"== {spec}: burst of {cal.burst} TTFT measured {fmt(cal.burst_ttft_s, 1e3, 1)} ms, "
             f"simulated {fmt(burst_ttft, 1e3, 1)} ms (lone {cal.ttft_s * 1e3:.1f} ms)")
    rows = []
    for i, rate in enumerate(args.rates):
        sim = simulate(topology, fit.profile, timed(sim_trace, rate), fit.cfg)
        row: dict[str, Any] = {"topology": spec, "rate": rate, **measured_cells([r.rates[i] for r in runs]),
                               **fitted_fields(fit), "burst_tpot_s": cal.burst_tpot_s, "lone_ttft_s": cal.ttft_s,
                               "burst_ttft_s": cal.burst_ttft_s, "simulated_burst_ttft_s": burst_ttft,
                               "lone_tpot_s": cal.tpot_s, "lone_instance_cpu_s": cal.cpu_s,
                               "ttft_noise_s": fit.cfg.ttft_noise_s, "tpot_noise": fit.cfg.tpot_noise,
                               "calibrations": [asdict(r.cal) for r in runs],
                               "instance_budgets": fit.cfg.instance_budgets,
                               "load_avg_1m": max(r.load_avg_1m for r in runs)}
        for m in METRICS:
            row[f"simulated_{m}"] = getattr(sim, m)
            row[f"error_{m}"] = error_pct(getattr(sim, m), row[f"measured_{m}"])
        rows.append(row)
    return rows


def resimulate(doc: dict[str, Any], profile: StepProfile, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of a saved run (`--out-json`) compared again with the simulator as it is
    now (and as the flags say), on the same measurements and calibrations: what a change
    to the simulator or the fit does, without measuring again."""
    args = argparse.Namespace(**{**vars(args), **doc["workload"], "instance_cpus": doc["instance_cpus"]})
    trace = make_trace(args)  # the saved run's
    by_topology: dict[str, list[dict[str, Any]]] = {}
    for row in doc["rows"]:
        by_topology.setdefault(row["topology"], []).append(row)
    rows: list[dict[str, Any]] = []
    for spec, saved in by_topology.items():
        cals = [Calibration(**c) for c in saved[0]["calibrations"]]
        budgets = {k: (int(v[0]), int(v[1])) for k, v in saved[0]["instance_budgets"].items()}
        runs = [MeasuredRun(cal, [{"completed": row["completed"] // row["runs"],
                                   "num_requests": row["num_requests"] // row["runs"],
                                   **{m: row[f"measured_{m}_runs"][k] for m in METRICS}} for row in saved],
                            max(row["load_avg_1m"] for row in saved), budgets)
                for k, cal in enumerate(cals)]
        rows += compare(spec, parse_topology(spec), profile, trace, runs,
                        argparse.Namespace(**{**vars(args), "rates": [row["rate"] for row in saved]}))
    return rows


def simulated_burst_ttft(topology: dict[InstanceType, int], fit: Fitted, request: TraceRequest,
                         burst: int) -> float | None:
    """The fitted simulator's median TTFT of the calibration's burst (`burst` copies of
    `request` at once), without the lone requests' spread. Against the measured one it says
    how the fitted per-request costs hold when requests come together (on this machine the
    served burst waited longer than they explain: 2026-12-03, docs/planner.md)."""
    cfg = fit.cfg.model_copy(update={"ttft_noise_s": [], "tpot_noise": []})
    return simulate(topology, fit.profile, [request.model_copy(update={"t": 0.0})] * burst, cfg).ttft_p50_s


def fitted_fields(fit: Fitted) -> dict[str, Any]:
    """What a fit found, for the JSON report."""
    return {"ttft_overhead_s": fit.cfg.ttft_overhead_s, "request_work_s": fit.cfg.request_work_s,
            "decode_token_overhead_s": fit.profile.decode_token_overhead_s,
            "step_overhead_s": fit.profile.step_overhead_s}


LABELS = {"ttft_p50_s": "TTFT p50", "ttft_p90_s": "TTFT p90", "tpot_p50_s": "TPOT p50", "tpot_p90_s": "TPOT p90"}


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per topology, rate and metric: measured, simulated (ms), error %."""
    repeated = any(r.get("runs", 1) > 1 for r in rows)
    head = ("topology", "rate", "ok", "load1m", "metric", "measured", "simulated", "error%",
            *(("repeat%",) if repeated else ()))
    lines = ["  ".join(f"{h:>9}" for h in head)]
    for r in rows:
        for m in METRICS:
            cells = [r["topology"], fmt(float(r["rate"]), 1, 2), f"{r['completed']}/{r['num_requests']}",
                     fmt(r["load_avg_1m"], 1, 2), LABELS[m], fmt(r[f"measured_{m}"], 1e3, 1),
                     fmt(r[f"simulated_{m}"], 1e3, 1), fmt(r[f"error_{m}"], 1, 1),
                     *((fmt(r.get(f"repeat_spread_{m}"), 1, 1),) if repeated else ())]
            lines.append("  ".join(f"{c:>9}" for c in cells))
    errs = [abs(r[f"error_{m}"]) for r in rows for m in METRICS if r[f"error_{m}"] is not None]
    if errs:
        lines.append(f"\nmeasured / simulated in ms; error% = (sim - real) / real. Mean |error| "
                     f"{statistics.mean(errs):.1f}%, max {max(errs):.1f}%, {sum(e <= 15 for e in errs)}/{len(errs)} "
                     "within 15%.")
        for m in METRICS:
            part = [abs(r[f"error_{m}"]) for r in rows if r[f"error_{m}"] is not None]
            if part:
                lines.append(f"  {LABELS[m]}: mean |error| {statistics.mean(part):.1f}%")
    spreads = [r[f"repeat_spread_{m}"] for r in rows for m in METRICS if r.get(f"repeat_spread_{m}") is not None]
    if spreads:
        lines.append(f"measured: the median of {max(r.get('runs', 1) for r in rows)} deployments per topology; "
                     f"repeat% = (max - min) / median over them: mean {statistics.mean(spreads):.1f}%, "
                     f"{sum(x > 15 for x in spreads)}/{len(spreads)} cells whose runs differ by more than 15%.")
    return "\n".join(lines)


def cli_main(args: argparse.Namespace) -> int:
    from triptych.cli_args import resolve_model

    try:
        topologies = {s.strip(): parse_topology(s.strip()) for s in args.topologies.split(",") if s.strip()}
        if not topologies or not args.rates or any(r <= 0 for r in args.rates) or args.repeats < 1:
            raise BenchError("need --topologies, positive --rates and --repeats of at least 1")
        if args.resimulate:
            if not args.profile:
                raise BenchError("--resimulate needs --profile (the profile the saved run used)")
            rows = resimulate(json.loads(Path(args.resimulate).read_text()), StepProfile.load(args.profile), args)
            print(format_table(rows))
            return 0
        model_dir = resolve_model(args.model)
        if args.profile:
            profile = StepProfile.load(args.profile)
        else:
            out = Path(args.save_profile) if args.save_profile else Path(tempfile.mkdtemp()) / "profile.json"
            progress(f"measuring a profile of {model_dir.name} at {args.instance_cpus} CPUs -> {out}")
            profile = measure_profile(model_dir, out, args.instance_cpus)
        trace = make_trace(args)
        rows: list[dict[str, Any]] = []
        for spec, topo in topologies.items():
            done = run_topology(spec, topo, model_dir, profile, trace, args)
            rows.extend(done)
            # Each topology's table as soon as it is measured (and the JSON so far): a run cut
            # short by a time limit still leaves what it compared.
            progress(format_table(done))
            save(args, profile, rows, complete=False)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = save(args, profile, rows, complete=True)
    print(json.dumps(result, indent=2) if args.json else format_table(rows))
    return 0


def save(args: argparse.Namespace, profile: StepProfile, rows: list[dict[str, Any]], *,
         complete: bool) -> dict[str, Any]:
    """The result document, written to --out-json when given; `complete` is false while
    topologies remain."""
    result = {"rows": rows, "complete": complete, "profile_source": profile.source,
              "instance_cpus": args.instance_cpus, "priority": args.priority, "repeats": args.repeats,
              "workload": {"num_requests": args.num_requests, "images_per_request": args.images_per_request,
                           "seed": args.seed,
                           "image_size": list(args.image_size), "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens}}
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result
