"""`triptych bench neighbours`: does an instance keep its capacity when its neighbours get busy?

On a GPU cluster an instance owns its accelerator; locally every instance shares the same
cores. This starts one EPD instance (the target, behind its own router) and N more EPD
instances (the neighbours, behind a second router), all with the same torch threads
(ceil(X)), and measures the target's decode throughput twice: alone (neighbours idle),
and while the neighbours decode as fast as they can under a closed-loop load. It does so
with every instance capped at X CPUs (triptych.cpu_quota) and, for contrast, without caps.

With quotas the two figures should agree (the target's share does not depend on what its
neighbours do); without, the target alone uses the cores its neighbours leave idle.
A quota is a ceiling, not a guarantee: on a machine busier than the quotas add up to
(other users, the routers and this client are uncapped), an instance gets less than X.
The target's and neighbours' CPU use (cores, from /proc/PID/stat) is reported per window
so that a reader can tell.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from triptych.bench.client import send_request
from triptych.bench.errors import BenchError
from triptych.bench.idle_cpu import cpu_seconds
from triptych.bench.report import fmt, progress
from triptych.bench.stats import RequestResult, percentile
from triptych.bench.workload import Workload, build_bodies
from triptych.cpu_quota import threads_for

TOLERANCE = 0.15  # alone vs with busy neighbours, with quotas (the bar)


async def _model(client: httpx.AsyncClient, url: str) -> str:
    resp = await client.get(f"{url}/v1/models", timeout=10.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _closed_loop(client: httpx.AsyncClient, url: str, bodies: Sequence[bytes], until: float,
                       stop: asyncio.Event | None, timeout_s: float,
                       results: list[RequestResult] | None = None) -> list[RequestResult]:
    """len(bodies) streams, each sending its body again as soon as the last finished, until
    `until` (monotonic) passes or `stop` is set; the finished requests go to `results`."""
    results = [] if results is None else results

    async def stream(body: bytes) -> None:
        while time.monotonic() < until and not (stop and stop.is_set()):
            results.append(await send_request(client, f"{url}/v1/chat/completions", body, timeout_s))

    await asyncio.gather(*(stream(b) for b in bodies))
    return results


def _throttle_stat(dep: Any) -> dict[str, int]:
    """The target's cgroup counters; empty without a quota."""
    return dep.quota.cpu_stat(dep.workers[0].name) if dep.quota is not None else {}


def _cores(pids: Sequence[int], before: Sequence[float], seconds: float) -> float:
    return sum(cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)) / seconds


async def _window(client: httpx.AsyncClient, target: Any, bodies: Sequence[bytes], seconds: float,
                  neighbour_pids: Sequence[int], timeout_s: float,
                  apparatus_pids: Sequence[int]) -> dict[str, Any]:
    """The target's output tokens per second over a closed loop of `seconds`, and the cores
    the target, its neighbours and the uncapped apparatus (both routers, this client and
    the neighbours' load generator) used meanwhile."""
    tpid = target.workers[0].popen.pid
    t_before, n_before = [cpu_seconds(tpid)], [cpu_seconds(p) for p in neighbour_pids]
    a_before = [cpu_seconds(p) for p in apparatus_pids]
    stat_before = _throttle_stat(target)
    start = time.monotonic()
    results = await _closed_loop(client, target.router_url, bodies, start + seconds, None, timeout_s)
    elapsed = time.monotonic() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise BenchError(f"{len(failed)} target request(s) failed, e.g. {failed[0]}")
    tokens = sum(r.num_tokens for r in results)
    tpots = [r.tpot for r in results if r.tpot is not None]
    stat = {k: v - stat_before.get(k, 0) for k, v in _throttle_stat(target).items()}
    throttled = stat["nr_throttled"] / stat["nr_periods"] if stat.get("nr_periods") else None
    return {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 2),
            "tpot_p50_s": percentile(tpots, 50), "requests": len(results),
            "throttled_share": None if throttled is None else round(throttled, 3),
            "target_cores": round(_cores([tpid], t_before, elapsed), 3),
            "neighbour_cores": round(_cores(neighbour_pids, n_before, elapsed), 3) if neighbour_pids else 0.0,
            "apparatus_cores": round(_cores(apparatus_pids, a_before, elapsed), 3)}


async def _measure(target: Any, neighbours: Any, cfg: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout), limits=limits,
                                 trust_env=False) as client:
        model_t = await _model(client, target.router_url)
        model_n = await _model(client, neighbours.router_url)
        work = Workload(num_requests=cfg.concurrency, images_per_request=0, prompt_len=8,
                        output_len=cfg.output_len)
        bodies = build_bodies(work, model_t, seed=1)
        n_pids = [w.popen.pid for w in neighbours.workers]
        for url, model in ((target.router_url, model_t), (neighbours.router_url, model_n)):
            body = build_bodies(work, model, seed=3)[0]  # warm-up: first requests pay one-off costs
            for _ in range(2):
                await send_request(client, f"{url}/v1/chat/completions", body, cfg.request_timeout)
        progress(f"  target alone for {cfg.seconds:g} s")
        apparatus = [os.getpid(), target.processes[-1].popen.pid, neighbours.processes[-1].popen.pid]
        alone = await _window(client, target, bodies, cfg.seconds, n_pids, cfg.request_timeout, apparatus)
        progress(f"    {alone['tokens_per_s']} tok/s")
        # The neighbours' load comes from another process: streams parsed in this event
        # loop would slow the target's client, not the target.
        load = subprocess.Popen([sys.executable, "-m", "triptych.bench.neighbours", neighbours.router_url,
                                 str(cfg.concurrency * cfg.neighbours), str(cfg.output_len),
                                 str(cfg.request_timeout)], stdout=subprocess.PIPE, text=True)
        try:
            await asyncio.sleep(cfg.ramp)
            if load.poll() is not None:
                raise BenchError(f"the neighbours' load generator exited with code {load.returncode}")
            progress(f"  target with {cfg.neighbours} busy neighbours for {cfg.seconds:g} s")
            crowded = await _window(client, target, bodies, cfg.seconds, n_pids, cfg.request_timeout,
                                    [*apparatus, load.pid])
        finally:
            load.send_signal(signal.SIGTERM)
            out, _ = load.communicate(timeout=60)
        progress(f"    {crowded['tokens_per_s']} tok/s")
        if not out.strip():
            raise BenchError(f"the neighbours' load generator reported nothing (exit code {load.returncode})")
        tally = json.loads(out.strip().splitlines()[-1])
        progress(f"    neighbours: {tally['completed']} requests completed meanwhile")
        if tally["failed"]:
            raise BenchError(f"{tally['failed']} neighbour request(s) failed, e.g. {tally['error']}")
    ratio = crowded["tokens_per_s"] / alone["tokens_per_s"] if alone["tokens_per_s"] else None
    return {"alone": alone, "with_neighbours": crowded, "ratio": None if ratio is None else round(ratio, 3),
            "neighbour_requests_completed": tally["completed"]}


async def _load(url: str, streams: int, output_len: int, timeout_s: float) -> dict[str, Any]:
    """Closed-loop load on `url` until SIGTERM; requests in flight then are cancelled (the
    router aborts them). Counts completed and failed requests."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        model = await _model(client, url)
        bodies = build_bodies(Workload(num_requests=streams, images_per_request=0, prompt_len=8,
                                       output_len=output_len), model, seed=2)
        results: list[RequestResult] = []
        task = asyncio.create_task(_closed_loop(client, url, bodies, float("inf"), stop, timeout_s, results))
        await stop.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    failed = [r.error for r in results if not r.ok]
    return {"completed": len(results) - len(failed), "failed": len(failed),
            "error": failed[0] if failed else None}


def run_mode(cfg: argparse.Namespace, quota: bool) -> dict[str, Any]:
    """Start the target and its neighbours (capped at cfg.instance_cpus if `quota`), measure, stop."""
    from triptych.cli_args import resolve_model
    from triptych.local import LocalDeployment
    from triptych.topology import parse_topology

    model = resolve_model(cfg.model)
    threads = threads_for(cfg.instance_cpus)
    common = {"model": model, "transfer_require": "any", "worker_args": ["--threads", str(threads)],
              "instance_cpus": cfg.instance_cpus if quota else None, "cpu_priority": cfg.priority}
    target = LocalDeployment(topology=parse_topology("EPD"), **common)  # type: ignore[arg-type]
    neighbours = LocalDeployment(topology=parse_topology(f"{cfg.neighbours}EPD"),
                                 **common)  # type: ignore[arg-type]
    label = f"quota {cfg.instance_cpus:g} CPU each, priority {cfg.priority:g}" if quota else "no quota"
    progress(f"== {label}: 1 target + {cfg.neighbours} neighbour EPD instances, {threads} thread(s) each")
    with target, neighbours:
        capped = target.quota is not None and neighbours.quota is not None
        if quota and not capped:
            raise BenchError(f"no CPU quota could be set: {target.quota_error or neighbours.quota_error}")
        out = asyncio.run(_measure(target, neighbours, cfg))
    return {"quota_cpus": cfg.instance_cpus if quota else None, "threads": threads, **out}


def format_table(modes: Sequence[dict[str, Any]]) -> str:
    head = ("mode", "alone tok/s", "busy tok/s", "busy/alone", "tpot50 alone/busy ms", "target cores a/b",
            "neighbour cores a/b", "routers+clients cores a/b", "throttled% a/b")
    rows = [head]
    for m in modes:
        a, b = m["alone"], m["with_neighbours"]
        mode = f"quota {m['quota_cpus']:g}" if m["quota_cpus"] else "no quota"
        rows.append((mode, fmt(a["tokens_per_s"], 1, 1),
                     fmt(b["tokens_per_s"], 1, 1), fmt(m["ratio"], 1, 3),
                     f"{fmt(a['tpot_p50_s'], 1e3, 1)}/{fmt(b['tpot_p50_s'], 1e3, 1)}",
                     f"{a['target_cores']:.2f}/{b['target_cores']:.2f}",
                     f"{a['neighbour_cores']:.2f}/{b['neighbour_cores']:.2f}",
                     f"{a['apparatus_cores']:.2f}/{b['apparatus_cores']:.2f}",
                     f"{fmt(a['throttled_share'], 100, 0)}/{fmt(b['throttled_share'], 100, 0)}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _load_main(argv: Sequence[str]) -> None:
    url, streams, output_len, timeout_s = argv
    print(json.dumps(asyncio.run(_load(url, int(streams), int(output_len), float(timeout_s)))), flush=True)


def cli_main(args: argparse.Namespace) -> int:
    from triptych.local import StartupError

    try:
        if args.neighbours < 1 or args.concurrency < 1 or args.output_len < 2 or not args.seconds > 0:
            raise BenchError("need --neighbours >= 1, --concurrency >= 1, --output-len >= 2, --seconds > 0")
        modes = [run_mode(args, quota=True)]
        if not args.no_contrast:
            modes.append(run_mode(args, quota=False))
    except (BenchError, StartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    capped = modes[0]
    within = capped["ratio"] is not None and abs(1 - capped["ratio"]) <= TOLERANCE
    result = {"instance_cpus": args.instance_cpus, "priority": args.priority, "neighbours": args.neighbours,
              "concurrency": args.concurrency,
              "output_len": args.output_len, "seconds": args.seconds, "modes": modes,
              "quota_within_tolerance": within, "tolerance": TOLERANCE}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(modes))
        print(f"\nwith quotas, busy/alone = {fmt(capped['ratio'], 1, 3)}: "
              f"{'within' if within else 'NOT within'} {TOLERANCE:.0%}. cores a/b: CPU used alone/with busy "
              f"neighbours (/proc/PID/stat; routers+clients: both routers, this client and the neighbours' "
              f"load generator, all uncapped); throttled%: share of the target's quota periods in which it hit "
              f"its quota (cgroup cpu.stat). A quota is a ceiling: on an oversubscribed machine an instance "
              f"gets less than its share, and then is rarely throttled.")
    return 0


if __name__ == "__main__":  # the neighbours' load generator (a process of its own)
    _load_main(sys.argv[1:])
