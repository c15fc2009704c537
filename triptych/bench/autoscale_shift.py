"""`triptych bench autoscale-shift`: a local, capacity-faithful deployment under a workload
shift, with the planner (`serve --autoscale`) and without it (issue 11, "Must show").

One trace, two phases at the same rate: before the shift requests carry images (E and P
share the work), after it they are text-only with long prompts (the prefill stage is the
bottleneck and the encoders idle), as EPDServe Table 6 shifts a workload mid-run. The same
trace is replayed twice against `--topology` with every instance capped at
`--instance-cpus` (triptych/cpu_quota.py): once with the planner beside the deployment
(`triptych autoscale`, whose reactive rule should move an idle E to P, a zero-loss role
switch through the router's admin API) and once without. Reported per run: SLO
attainment before and after the shift (and over the second half of the after phase, once
a move has had time to act), TTFT p90 after, requests lost (failed: must be 0), the
planner's decisions (polled from its `/plan`) and the final instance counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from triptych.bench.client import discover
from triptych.bench.errors import BenchError
from triptych.bench.loadgen import run_rate
from triptych.bench.report import fmt, progress
from triptych.bench.stats import SLO, RequestResult, percentile, slo_attainment
from triptych.bench.trace import calibrate, trace_bodies
from triptych.http_ready import answers_ok
from triptych.operator.planner.workload import TraceRequest, WorkloadSpec, fixed, generate

SHIFT_DEFAULTS = {
    # image requests -> long text-only prompts: prefill is the bottleneck, the encoders idle
    "text": {"before_images": 2, "before_output": 16, "after_images": 0, "after_prompt": 800, "after_output": 16,
             "rate": 2.0, "tbt_slo": 0.2, "instance_cpus": 0.5, "priority": 1.0, "phase_seconds": 40.0,
             "after_seconds": None},
    # EPDServe Table 6: the same requests, outputs 50 -> 500 tokens: decode is the
    # bottleneck, and it shows as slower tokens, not as a queue (operator/planner/policy.py).
    # Sized so that the shift overloads the one D (2E1P1D at 0.25 CPU each, 1 CPU in all):
    # at 1.5 req/s x 500 tokens the D is asked for 750 tokens/s, more than it decodes at
    # 0.25 CPU (each decode in its batch costs it ~1.5 ms a step), so its batch and TPOT
    # grow for as long as the phase lasts; two Ds at 375 tokens/s each keep TPOT near
    # 20 ms, under the 50 ms TBT SLO. The after phase lasts long enough (120 s) for a move
    # and the decodes seated before it (10 s or more each) to play out.
    "outputs": {"before_images": 1, "before_output": 50, "after_images": None, "after_prompt": None,
                "after_output": 500, "rate": 1.5, "tbt_slo": 0.05, "instance_cpus": 0.25, "priority": 16.0,
                "phase_seconds": 30.0, "after_seconds": 120.0},
}


def resolve_shift(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the phase flags left unset from the --shift mode's defaults (None: the same as
    before the shift)."""
    for key, value in SHIFT_DEFAULTS[getattr(args, "shift", "text")].items():
        if getattr(args, key, None) is None:
            if value is None and key.startswith("after_") and hasattr(args, key.replace("after_", "before_")):
                value = getattr(args, key.replace("after_", "before_"))
            setattr(args, key, value)
    return args


def shift_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], int]:
    """The two phases end to end; the number of requests before the shift."""
    resolve_shift(args)
    def phase(images: int, prompt: int, output: int, seed: int, seconds: float) -> list[TraceRequest]:
        n = max(2, round(args.rate * seconds))
        return generate(WorkloadSpec(rate=args.rate, num_requests=n, images_per_request=fixed(images),
                                     image_size=tuple(args.image_size), prompt_tokens=fixed(prompt),
                                     output_tokens=fixed(output), seed=seed))
    before = phase(args.before_images, args.before_prompt, args.before_output, args.seed, args.phase_seconds)
    after = phase(args.after_images, args.after_prompt, args.after_output, args.seed + 1,
                  args.after_seconds or args.phase_seconds)
    t0 = before[-1].t
    return before + [r.model_copy(update={"t": r.t + t0}) for r in after], len(before)


def planner_args(args: argparse.Namespace) -> list[str]:
    resolve_shift(args)
    return ["--interval", str(args.interval), "--sustain", str(args.sustain),
            "--role-switch-cooldown", str(args.role_switch_cooldown),
            "--max-queue-per-instance", str(args.max_queue_per_instance), "--no-encoder-scaling",
            "--slo-ttft", str(args.ttft_slo), "--slo-tbt", str(args.tbt_slo)]


async def _poll_plan(client: httpx.AsyncClient, url: str, t0: float, out: dict[str, Any],
                     stop: asyncio.Event) -> None:
    """Every action the planner takes (its /plan's last_action, deduplicated by time) and
    the counts over time."""
    seen: set[float] = set()
    while not stop.is_set():
        try:
            doc = (await client.get(f"{url}/plan", timeout=5.0)).json()
        except (httpx.HTTPError, ValueError):
            doc = {}
        act = doc.get("last_action")
        if act and act["at"] not in seen:
            seen.add(act["at"])
            out["actions"].append({"t_s": round(act["at"] - t0, 1), "action": act["action"], "rule": act["rule"],
                                   "from": act.get("from_type"), "to": act.get("to_type"), "reason": act["reason"],
                                   "error": doc.get("actuation_error")})
        if doc.get("counts"):
            out["counts"] = doc["counts"]
            out["decisions"] = doc.get("decisions", 0)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


def _phase(results: list[RequestResult], slo: SLO) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "slo_attainment": slo_attainment(results, slo.ttft_s, slo.tbt_s),
            "ttft_p90_s": percentile([r.ttft for r in ok if r.ttft is not None], 90),
            "tpot_p90_s": percentile([r.tpot for r in ok if r.tpot is not None], 90)}


async def _replay(router: str, planner: str | None, trace: list[TraceRequest], n_before: int, slo: SLO,
                  timeout_s: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        model, ends = await discover(client, router, [], {})
        scale = await calibrate(client, router, model, {})
        bodies = trace_bodies(trace, model, seed=7, scale=scale)
        plan: dict[str, Any] = {"actions": [], "counts": None, "decisions": 0}
        stop = asyncio.Event()
        t0 = time.time()
        poller = asyncio.create_task(_poll_plan(client, planner, t0, plan, stop)) if planner else None
        load = [os.getloadavg()[0]]
        report, _, _ = await run_rate(client, ends, bodies, len(trace) / max(trace[-1].t, 1e-9), 0, slo,
                                      timeout_s, arrivals=[r.t for r in trace])
        load.append(os.getloadavg()[0])
        stop.set()
        if poller is not None:
            await poller
    results: list[RequestResult] = report["_results"]
    after = results[n_before:]
    half = len(after) // 2
    return {"before": _phase(results[:n_before], slo), "after": _phase(after, slo),
            "after_2nd_half": _phase(after[half:], slo), "lost": sum(not r.ok for r in results),
            "errors": sorted({r.error for r in results if r.error})[:3], "load_avg_1m": max(load),
            "planner": plan if planner else None}


def run_once(args: argparse.Namespace, trace: list[TraceRequest], n_before: int, autoscale: bool) -> dict[str, Any]:
    from triptych.cli_args import resolve_model
    from triptych.local import LocalDeployment, _admin_token_file, free_port, start_planner
    from triptych.topology import parse_topology

    token = secrets.token_urlsafe(32)
    token_file = _admin_token_file(token)
    mode = "autoscale" if autoscale else "static"
    dep = LocalDeployment(model=resolve_model(args.model), topology=parse_topology(args.topology),
                          transfer_require=args.transfer_require, instance_cpus=args.instance_cpus,
                          cpu_priority=args.priority, cpu_period_ms=args.instance_cpu_period_ms,
                          admin_token=token,
                          router_args=["--admin-token-file", str(token_file)],
                          log_dir=Path(args.log_dir) / mode if args.log_dir else None)
    slo = SLO(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo)
    with dep:
        if args.instance_cpus and dep.quota is None:
            progress(f"warning: running WITHOUT CPU quotas ({dep.quota_error})")
        planner = None
        try:
            if autoscale:
                planner = start_planner(dep, token_file, free_port(), planner_args(args))
                _wait_http(f"{planner.url}/plan", 120.0)
            progress(f"== {mode}: {args.topology}, {len(trace)} requests, shift after {n_before}")
            out = asyncio.run(_replay(dep.router_url, planner.url if planner else None, trace, n_before, slo,
                                      args.request_timeout))
        finally:
            if planner is not None:
                planner.popen.terminate()
                planner.popen.wait(timeout=30)
    out["mode"] = mode
    return out


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers_ok(url):
            return
        time.sleep(0.5)
    raise BenchError(f"{url} did not answer within {timeout_s:.0f} s")


def format_report(runs: list[dict[str, Any]]) -> str:
    head = ("mode", "before%", "after%", "after2nd%", "ttft90after", "tpot90after", "lost", "load1m",
            "final counts")
    lines = ["  ".join(f"{h:>12}" for h in head)]
    for r in runs:
        counts = (r["planner"] or {}).get("counts") or "-"
        cells = (r["mode"], fmt(r["before"]["slo_attainment"], 100, 1), fmt(r["after"]["slo_attainment"], 100, 1),
                 fmt(r["after_2nd_half"]["slo_attainment"], 100, 1), fmt(r["after"]["ttft_p90_s"], 1, 3),
                 fmt(r["after"].get("tpot_p90_s"), 1, 3),
                 str(r["lost"]), fmt(r["load_avg_1m"], 1, 2), json.dumps(counts) if counts != "-" else "-")
        lines.append("  ".join(f"{c:>12}" for c in cells))
    for r in runs:
        if r["planner"] is not None:
            lines.append(f"\nplanner ({r['mode']}): {r['planner']['decisions']} decisions, actions:")
            for a in r["planner"]["actions"] or [{"t_s": "-", "action": "none", "reason": "no action"}]:
                lines.append(f"  t={a['t_s']} s {a['action']}: {a['reason']}" + (f" (error: {a['error']})"
                                                                                 if a.get("error") else ""))
    return "\n".join(lines)


def cli_main(args: argparse.Namespace) -> int:
    resolve_shift(args)
    try:
        trace, n_before = shift_trace(args)
        runs = [run_once(args, trace, n_before, autoscale) for autoscale in (True, False)]
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {"shift": args.shift, "topology": args.topology, "instance_cpus": args.instance_cpus, "rate": args.rate,
              "phase_seconds": args.phase_seconds, "shift_after": n_before, "runs": runs}
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else format_report(runs))
    return 0
