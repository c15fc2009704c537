"""The calibration of `triptych bench simulate-validate`: what a served request costs a
capacity-faithful local deployment beyond the profile's steps, from lone requests and
small bursts sent before the load (no queueing), and several deployments' calibrations
pooled into one. `sim_validate.fit_overheads` turns it into the simulator's fixed costs."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field

import httpx

from triptych.bench.client import discover, send_request
from triptych.bench.errors import BenchError
from triptych.bench.idle_cpu import cpu_seconds
from triptych.bench.trace import calibrate, trace_bodies
from triptych.operator.planner.workload import TraceRequest


@dataclass
class Calibration:
    """What a served request costs beyond the profile's steps, measured before the load."""

    ttft_s: float  # median TTFT of a lone request
    tpot_s: float  # its median TPOT
    burst_tpot_s: float  # median TPOT of `burst` identical requests sent at once
    burst: int
    cpu_s: dict[str, float]  # CPU seconds per lone request, by instance type
    template_tokens: int
    ttft_noise_s: list[float] = field(default_factory=list)  # each timed lone TTFT less their median
    tpot_noise: list[float] = field(default_factory=list)  # each timed lone TPOT over their median
    idle_cores: dict[str, float] = field(default_factory=dict)  # by type: CPU burnt with no request (taken out of cpu_s)
    burst_ttft_s: float | None = None  # median TTFT of the burst's requests

    def noise(self) -> dict[str, list[float]]:
        """The lone requests' spread as `SimConfig` fields: what the environment adds to a
        request that the simulator's deterministic steps do not (on a capped instance, where
        in the quota's period its work falls; OS scheduling on shared cores)."""
        return {"ttft_noise_s": self.ttft_noise_s, "tpot_noise": self.tpot_noise}


def request_cpu_s(spent: dict[str, float], idle_cores: dict[str, float], elapsed_s: float,
                  requests: int) -> dict[str, float]:
    """CPU seconds per request, by instance type: what its instances spent (`spent`) while
    `requests` lone requests ran over `elapsed_s`, less what they burn with no request at
    all over that time (`idle_cores`: the router's health polls, timers; 0.004-0.008 cores
    an instance here). Left in, that background is charged as request work: at a lone
    request every 0.7 s about 4 ms of CPU each, 16 ms of busy time at a quarter of a core,
    which the simulator then queues later requests behind at every rate."""
    return {k: max(0.0, (cpu - idle_cores.get(k, 0.0) * elapsed_s) / requests) for k, cpu in spent.items()}


async def calibrate_requests(url: str, trace: list[TraceRequest], pids: dict[str, list[int]],
                             lone_timed: int = 15, burst: int = 4, burst_repeats: int = 3,
                             pause_s: float = 0.5, warmups: int = 30, idle_s: float = 5.0) -> Calibration:
    """Lone requests shaped like the trace's first (`warmups` untimed: a fresh deployment's
    first requests are slower, 1E1P1D at 0.25 CPU: TTFT median 64 ms over its requests 2-10
    against 43 ms over 11-30, another deployment 51 ms over 2-12 and 41 after; with ten
    warm-ups the lone requests were slower than the same requests under load, and the
    simulator over-predicted the loaded runs; then `lone_timed` timed; no
    queueing): their median TTFT and TPOT and the CPU seconds the instances of each type
    (`pids` by type) spent per request; then `burst_repeats` bursts of `burst` of them sent
    at once, for the TPOT of a decode batch of `burst` (what splits the served path's cost
    per token into a part per step, which a batch shares, and a part per request). Between
    the warm-ups and the timed requests, `idle_s` with no request gives each type's idle
    CPU, taken out of its CPU per request (`request_cpu_s`). Each
    starts `pause_s` after the last ended: sent back to back, a request would meet its
    predecessor's tail (the release of its hand-overs) on the instances and time that too,
    which requests of a trace at a moderate rate do not."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as client:
        model, ends = await discover(client, url, [], {})
        scale = await calibrate(client, url, model, {})
        lone = lone_timed + warmups
        bodies = trace_bodies([trace[0]] * (lone + burst * burst_repeats), model, seed=99, scale=scale)
        endpoint = f"{url}/v1/chat/completions"
        ttfts, tpots = [], []
        cpu0: dict[str, float] = {}
        idle: dict[str, float] = {}
        t0 = 0.0
        for i, body in enumerate(bodies[:lone]):
            if i == warmups:
                idle = await _idle_cores(pids, idle_s)
                cpu0, t0 = _cpu(pids), time.monotonic()
            await asyncio.sleep(pause_s)  # what the last request left (its hand-overs' release) is done
            r = await send_request(client, endpoint, body, 120.0)
            if not r.ok or r.ttft is None:
                raise BenchError(f"lone request failed: {r.error}")
            ttfts.append(r.ttft)
            tpots.append(r.tpot or 0.0)
        spent = {name: cpu - cpu0[name] for name, cpu in _cpu(pids).items()}
        cpu = request_cpu_s(spent, idle, time.monotonic() - t0, lone_timed)
        burst_tpots, burst_ttfts = [], []
        rest = bodies[lone:]
        for k in range(burst_repeats):
            await asyncio.sleep(pause_s)
            results = await asyncio.gather(*(send_request(client, endpoint, b, 120.0)
                                             for b in rest[k * burst:(k + 1) * burst]))
            if not all(r.ok for r in results):
                raise BenchError(f"burst request failed: {[r.error for r in results if not r.ok][0]}")
            burst_tpots += [r.tpot for r in results if r.tpot is not None]
            burst_ttfts += [r.ttft for r in results if r.ttft is not None]
    ttft, tpot = statistics.median(ttfts[warmups:]), statistics.median(tpots[warmups:])
    return Calibration(ttft, tpot, statistics.median(burst_tpots) if burst_tpots else tpot, burst, cpu,
                       scale.template_tokens, [t - ttft for t in ttfts[warmups:]],
                       [t / tpot for t in tpots[warmups:]] if tpot > 0 else [], idle,
                       statistics.median(burst_ttfts) if burst_ttfts else None)


def _cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each type's instances (every thread, /proc)."""
    return {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}


async def _idle_cores(pids: dict[str, list[int]], seconds: float) -> dict[str, float]:
    """The cores each type's instances use over `seconds` with no request."""
    before, t = _cpu(pids), time.monotonic()
    await asyncio.sleep(seconds)
    after, elapsed = _cpu(pids), time.monotonic() - t
    return {name: (after[name] - before[name]) / elapsed for name in before} if elapsed > 0 else {}


def pooled(cals: list[Calibration]) -> Calibration:
    """Several deployments' calibrations as one: the medians of their medians, the mean CPU
    per request, every lone request's spread (around its own deployment's median), taken
    from each deployment in turn."""
    if len(cals) == 1:
        return cals[0]
    kinds = {k for c in cals for k in c.cpu_s}
    return Calibration(
        ttft_s=statistics.median(c.ttft_s for c in cals), tpot_s=statistics.median(c.tpot_s for c in cals),
        burst_tpot_s=statistics.median(c.burst_tpot_s for c in cals), burst=cals[0].burst,
        cpu_s={k: statistics.mean(c.cpu_s[k] for c in cals if k in c.cpu_s) for k in sorted(kinds)},
        template_tokens=cals[0].template_tokens, ttft_noise_s=_interleaved([c.ttft_noise_s for c in cals]),
        tpot_noise=_interleaved([c.tpot_noise for c in cals]),
        idle_cores={k: statistics.mean(c.idle_cores.get(k, 0.0) for c in cals) for k in sorted(kinds)},
        burst_ttft_s=_median_known([c.burst_ttft_s for c in cals]))


def _median_known(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def _interleaved(lists: list[list[float]]) -> list[float]:
    """One from each list in turn: a trace shorter than all of them together still draws
    from every deployment's spread."""
    return [x for group in itertools.zip_longest(*lists) for x in group if x is not None]
