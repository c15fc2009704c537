"""A discrete-event model of an E/P/D deployment driven by a workload.

Instances (sim_instance.py) batch like the engine; the router plans each request's path
when it arrives as router/routing.py does: walk E -> P -> D, keep the request on the
instance that ran the previous stage when it can run this one (no transfer), otherwise
choose among the capable instances by the policy (round-robin per stage, or least-loaded
on queued work plus requests in flight); a request's images are spread over the
encode-capable instances (intra-request parallel encoding, EPDServe §3.2.2), the first on
the hop's own instance. Embeddings move E -> P and KV moves P -> D at the profile's
migration cost by bytes (pull-based: the request then waits for the target to admit it).

It reports what `triptych bench serve` reports: TTFT and TPOT percentiles, SLO attainment
(HydraInfer §2.3: TTFT <= SLO and at least 90% of token gaps <= TBT SLO) and throughput;
`goodput` searches the highest rate whose attainment reaches the target.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.sim_config import SimConfig, SimReport
from triptych.operator.planner.sim_instance import Batch, SimInstance, SimRequest
from triptych.operator.planner.workload import TraceRequest
from triptych.slo_budgets import latency_limit
from triptych.topology import STAGE_ORDER, InstanceType, Stage

TBT_QUANTILE = 0.9  # HydraInfer §2.3, as router/metrics.py
ATTAINMENT_TARGET = 0.9
BACKLOG_SHARE = 0.05


def build_instances(topology: dict[InstanceType, int], profile: StepProfile, cfg: SimConfig) -> list[SimInstance]:
    out = []
    for kind, n in topology.items():
        if kind.value in cfg.instance_budgets:
            tokens, images = cfg.instance_budgets[kind.value]
        else:
            limit = latency_limit(kind, cfg.ttft_slo_s, cfg.tbt_slo_s, cfg.alpha)
            tokens = cfg.token_budget or profile.token_budget(limit)
            images = cfg.image_budget or profile.image_budget(limit, cfg.budget_image_pixels)
        out += [SimInstance(f"{kind.value}-{i}", kind, profile, token_budget=tokens, image_budget=images,
                            tbt_slo_s=cfg.tbt_slo_s, request_work_s=cfg.request_work_s.get(kind.value, 0.0),
                            request_work_beside=cfg.request_work_beside)
                for i in range(n)]
    return out


class _Router:
    def __init__(self, instances: Sequence[SimInstance], cfg: SimConfig) -> None:
        self.cfg = cfg
        self.capable = {s: sorted((i for i in instances if i.runs(s)), key=lambda i: i.name) for s in STAGE_ORDER}
        self._cursors = {s: itertools.count() for s in STAGE_ORDER}

    def choose(self, stage: Stage) -> SimInstance:
        cands = self.capable[stage]
        if not cands:
            raise ValueError(f"no instance of the topology runs the {stage.value} stage")
        if self.cfg.routing == "least-loaded":
            return min(cands, key=lambda i: (i.load + i.inflight, i.inflight))
        return cands[next(self._cursors[stage]) % len(cands)]

    def plan(self, req: SimRequest) -> None:
        """router/routing.py plan_path + spread_images."""
        stages = list(STAGE_ORDER) if req.image_tokens else [Stage.PREFILL, Stage.DECODE]
        hop: SimInstance | None = None
        for stage in stages:
            if hop is None or not hop.runs(stage):
                hop = self.choose(stage)
                hop.inflight += 1
            if stage is Stage.ENCODE:
                req.encoders = [hop] + [self.choose(Stage.ENCODE) if self.cfg.parallel_encode else hop
                                        for _ in req.image_tokens[1:]]
            elif stage is Stage.PREFILL:
                req.prefiller = hop
            else:
                req.decoder = hop


class Simulation:
    def __init__(self, topology: dict[InstanceType, int], profile: StepProfile, cfg: SimConfig) -> None:
        self.topology = {k: v for k, v in topology.items() if v > 0}
        self.profile, self.cfg = profile, cfg
        self.instances = build_instances(self.topology, profile, cfg)
        self.router = _Router(self.instances, cfg)
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._running: dict[str, tuple[Batch, float, int]] = {}
        self._puts: dict[tuple[int, str], Callable[[float], None]] = {}  # (request, instance): queue it there
        self.requests: list[SimRequest] = []
        self.missed = 0
        self._backlog: list[int] = []

    # --- event plumbing ---------------------------------------------------------------
    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _kick(self, inst: SimInstance, now: float) -> None:
        if inst.busy:
            cur = self._running.get(inst.name)
            if cur is not None and SimInstance.truncate(cur[0], cur[1], now):
                self._schedule_end(inst, cur[0], cur[1])
            return
        if not inst.has_work:
            return
        batch = inst.form_batch(now)
        if batch is None:
            return
        self._set_busy(inst, True, now)
        self._schedule_end(inst, batch, now)

    def _schedule_end(self, inst: SimInstance, batch: Batch, start: float) -> None:
        token = next(self._seq)
        self._running[inst.name] = (batch, start, token)
        self._at(start + batch.duration * batch.steps, lambda t: self._step_end(inst, batch, token, t))

    def _step_end(self, inst: SimInstance, batch: Batch, token: int, now: float) -> None:
        if self._running[inst.name][2] != token:
            return  # superseded by a truncated macro step
        self._set_busy(inst, False, now)
        prefilled, encoded, decoded = inst.finish_step(batch, now)
        for req in prefilled:
            self._first_token(req, now)
        for req in encoded:
            self._to_prefill(req, now)
        for req in decoded:
            self._done(req, inst)
        self._kick(inst, now)
        if not inst.busy and inst.owed:
            inst.settle_owed()

    # --- a request's path -------------------------------------------------------------
    def _arrive(self, req: SimRequest, now: float) -> None:
        self.router.plan(req)
        if req.image_tokens:
            req.images_left = len(req.image_tokens)
            for enc in set(req.encoders):
                tasks = [(req, i) for i, e in enumerate(req.encoders) if e is enc]

                def put(t: float, enc: SimInstance = enc, tasks: list[tuple[SimRequest, int]] = tasks) -> None:
                    enc.encode_queue.extend(tasks)
                    self._kick(enc, t)
                self._enter(enc, req, now, put)
        else:
            self._to_prefill(req, now, migrate=False)

    def _to_prefill(self, req: SimRequest, now: float, migrate: bool = True) -> None:
        target = req.prefiller
        assert target is not None
        remote = sum(tok for tok, enc in zip(req.image_tokens, req.encoders, strict=True) if enc is not target)
        delay = self.profile.migration_s(remote * self.profile.shape.embedding_bytes_per_token(
            self.profile.dtype_bytes)) if migrate else 0.0
        if req.encoders and req.encoders[0] is not target:
            req.encoders[0].inflight -= 1  # the encode hop is over (IRP helpers were never counted)

        def put(t: float) -> None:
            target.prefill_queue.append(req)
            self._kick(target, t)

        def arrive(t: float) -> None:
            self._enter(target, req, t, put)
        if delay > 0:
            self._at(now + delay, arrive)
        else:
            arrive(now)

    def _enter(self, inst: SimInstance, req: SimRequest, now: float, put: Callable[[float], None]) -> None:
        """`req` reaches `inst`; `put` queues it there once its request work is done
        (`SimInstance.advance_takings`)."""
        if not inst.takes_on_beside(req):
            put(now)
            return
        inst.advance_takings(now)
        inst.taking[req] = inst.request_work_s
        self._puts[id(req), inst.name] = put
        self._schedule_taken(inst, now)

    def _schedule_taken(self, inst: SimInstance, now: float) -> None:
        inst.taking_event += 1
        at = inst.next_taken(now)
        if at is not None:
            token = inst.taking_event
            self._at(at, lambda t: self._taken(inst, token, t))

    def _taken(self, inst: SimInstance, token: int, now: float) -> None:
        if token != inst.taking_event:
            return  # the sharing changed since: rescheduled
        inst.advance_takings(now)
        for req in [r for r, left in inst.taking.items() if left <= 1e-12]:
            del inst.taking[req]
            self._puts.pop((id(req), inst.name))(now)
        self._schedule_taken(inst, now)

    def _set_busy(self, inst: SimInstance, busy: bool, now: float) -> None:
        """A step starts or ends: the request work under way there shares the CPU anew."""
        if inst.taking:
            inst.advance_takings(now)
        inst.busy = busy
        if inst.taking:
            self._schedule_taken(inst, now)

    def _first_token(self, req: SimRequest, now: float) -> None:
        if now - req.arrival + self.cfg.ttft_extra_s(req.rid) > self.cfg.ttft_slo_s:
            req.missed = True
            self.missed += 1
        assert req.prefiller is not None and req.decoder is not None
        if req.output_tokens <= 1:
            req.finish = now
            if req.decoder is not req.prefiller:
                req.decoder.inflight -= 1  # planned, never used
            self._done(req, req.prefiller)
            return
        target = req.decoder
        if target is req.prefiller:
            target.decode_waiting.append(req)
            return  # the prefiller's step end kicks it
        req.prefiller.inflight -= 1
        nbytes = req.prompt_tokens * self.profile.shape.kv_bytes_per_token(self.profile.dtype_bytes)

        def put(t: float) -> None:
            target.decode_waiting.append(req)
            self._kick(target, t)

        def arrive(t: float) -> None:
            self._enter(target, req, t, put)
        self._at(now + self.profile.migration_s(nbytes), arrive)

    def _done(self, req: SimRequest, inst: SimInstance) -> None:
        inst.inflight -= 1
        if not req.missed and req.gaps and req.gaps - req.slow_gaps < TBT_QUANTILE * req.gaps:
            req.missed = True
            self.missed += 1

    # --- run --------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest] | CompiledTrace, stop_after_missed: int | None = None) -> SimReport:
        ct = trace if isinstance(trace, CompiledTrace) else CompiledTrace(trace, self.profile)
        for n, (t, tokens, pixels, text, out) in enumerate(ct.rows):
            req = SimRequest(rid=n, arrival=t, image_tokens=list(tokens), image_pixels=list(pixels),
                             text_tokens=text, output_tokens=out)
            self.requests.append(req)
            self._at(req.arrival, lambda t, r=req: self._arrive(r, t))
        if len(self.requests) > 1:  # sample the backlog twice: a rate is sustained only if it does not grow
            last = self.requests[-1].arrival
            for t in (last / 2, last):
                self._at(t, lambda _t: self._backlog.append(self._queued()))
        now, stopped = 0.0, False
        while self._events:
            now, _, fn = heapq.heappop(self._events)
            fn(now)
            if stop_after_missed is not None and self.missed > stop_after_missed:
                stopped = True
                break
        return self._report(ct.span, now, stopped)

    def _queued(self) -> int:
        """Requests waiting for a stage (not the ones being served)."""
        return sum(len(i.decode_waiting) + len(i.prefill_queue) + len(i.encode_queue) for i in self.instances)

    def _report(self, span: float, end: float, stopped: bool) -> SimReport:
        done = [r for r in self.requests if r.finish is not None]
        n = len(self.requests)
        met = sum(1 for r in done if not r.missed)
        cfg = self.cfg
        ttft = sorted(max(0.0, r.first_token - r.arrival + cfg.ttft_extra_s(r.rid)) for r in done
                      if r.first_token is not None)
        tpot = sorted(cfg.tpot_factor(r.rid) * (r.finish - r.first_token) / (r.output_tokens - 1) for r in done
                      if r.first_token is not None and r.output_tokens > 1)
        e2e = sorted(r.finish - r.arrival + cfg.ttft_extra_s(r.rid) for r in done)
        util: dict[str, list[float]] = {}
        for inst in self.instances:
            util.setdefault(inst.kind.value, []).append(inst.busy_time / end if end > 0 else 0.0)
        return SimReport(
            topology={k.value: v for k, v in self.topology.items()}, rate=(n - 1) / span if span > 0 else 0.0,
            num_requests=n, completed=len(done), slo_attainment=met / n if n else 0.0,
            **_pcts("ttft", ttft), **_pcts("tpot", tpot), e2e_p50_s=_pct(e2e, 0.5), e2e_p99_s=_pct(e2e, 0.99),
            throughput_rps=len(done) / end if end > 0 else 0.0, duration_s=end,
            utilization={k: sum(v) / len(v) for k, v in util.items()}, stopped_early=stopped,
            **self._sustained(n))

    def _sustained(self, n: int) -> dict[str, object]:
        """Overload makes queues grow without bound: over a longer trace its attainment would
        fall to 0, however well a finite trace's burst was absorbed. Allow the growth a
        stable queue shows by chance (5% of the requests, at least 10)."""
        if len(self._backlog) < 2:
            return {"backlog_growth": 0, "sustained": True}
        growth = self._backlog[1] - self._backlog[0]
        return {"backlog_growth": growth, "sustained": growth <= max(10, BACKLOG_SHARE * n)}


class CompiledTrace:
    """A trace as plain rows (arrival from 0, visual tokens per image, pixels per image, text
    tokens, output tokens), optionally tiled to `count` requests and re-timed to `rate`:
    the simulator's input without per-request validation on every run."""

    def __init__(self, trace: Sequence[TraceRequest], profile: StepProfile, *, rate: float | None = None,
                 count: int | None = None, _rows: list[tuple] | None = None) -> None:
        if _rows is None:
            shape, tok = profile.shape, {}
            t0 = trace[0].t if trace else 0.0
            _rows = []
            for r in trace:
                for wh in r.images:
                    if wh not in tok:
                        tok[wh] = shape.tokens_per_image(*wh)
                _rows.append((r.t - t0, tuple(tok[wh] for wh in r.images), tuple(w * h for w, h in r.images),
                              r.prompt_tokens, r.output_tokens))
        self.base = _rows
        self.rows = _rows
        if count is not None and len(_rows) < count:
            self.rows = _tile_rows(_rows, count)
        if rate is not None and len(self.rows) > 1:
            scale = (len(self.rows) - 1) / self.rows[-1][0] / rate if self.rows[-1][0] > 0 else 1.0
            self.rows = [(r[0] * scale, *r[1:]) for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def span(self) -> float:
        return self.rows[-1][0] - self.rows[0][0] if len(self.rows) > 1 else 0.0

    def at(self, rate: float, count: int | None = None) -> CompiledTrace:
        return CompiledTrace([], None, rate=rate, count=count, _rows=self.base)  # type: ignore[arg-type]


def _tile_rows(rows: list[tuple], count: int) -> list[tuple]:
    span = rows[-1][0]
    period = span + (span / (len(rows) - 1) if len(rows) > 1 else 1.0)
    out: list[tuple] = []
    copy = 0
    while len(out) < count:
        out += [(r[0] + copy * period, *r[1:]) for r in rows]
        copy += 1
    return out[:count]


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _pcts(name: str, xs: Sequence[float]) -> dict[str, float | None]:
    return {f"{name}_p{int(q * 100)}_s": _pct(xs, q) for q in (0.5, 0.9, 0.99)}


def simulate(topology: dict[InstanceType, int], profile: StepProfile, trace: Sequence[TraceRequest] | CompiledTrace,
             cfg: SimConfig, stop_below: float | None = None) -> SimReport:
    """One run; with `stop_below`, stop as soon as the attainment cannot reach it."""
    limit = None if stop_below is None else int(len(trace) * (1 - stop_below))
    return Simulation(topology, profile, cfg).run(trace, limit)


class Goodput(BaseModel):
    goodput_rps: float
    attainment_by_rate: dict[str, float]
    simulations: int


def capped(arrivals: int, max_requests: int | None) -> int:
    """A simulated run's arrivals, at most `max_requests` (None: no cap)."""
    return arrivals if max_requests is None else min(arrivals, max_requests)


def goodput(topology: dict[InstanceType, int], profile: StepProfile, trace: Sequence[TraceRequest] | CompiledTrace,
            cfg: SimConfig, guess: float, *, target: float = ATTAINMENT_TARGET, step: float = 1.03,
            max_runs: int = 24, min_duration_s: float = 30.0, max_requests: int | None = None) -> Goodput:
    """HydraInfer §2.3: the highest rate with attainment >= target, searched on the grid
    guess * step**-k (k integer, either sign): gallop from the guess (an analytic capacity
    bound) until one rate passes and one fails, then bisect over k (attainment falls as the
    rate rises). One grid for every candidate makes them comparable: equal goodputs mean
    the same grid cell, i.e. equal within `step`. Each run lasts at least `min_duration_s`
    of arrivals (the trace is tiled), long enough for an overload's backlog to show, and
    holds at most `max_requests` (a live replan's time bound: a small model on a large GPU
    serves thousands of requests a second, and 30 s of them take minutes to simulate)."""
    if not math.isfinite(guess) or guess <= 0:
        guess = 1.0  # no analytic bound (e.g. a workload that needs no stage the bound prices)
    cache: dict[int, float] = {}
    compiled = trace if isinstance(trace, CompiledTrace) else CompiledTrace(trace, profile)

    def passes(k: int) -> bool:
        if k not in cache:
            rate = guess * step ** -k
            run = compiled.at(rate, capped(math.ceil(rate * min_duration_s), max_requests))
            r = simulate(topology, profile, run, cfg, stop_below=target)
            cache[k] = r.slo_attainment if r.sustained else -r.slo_attainment  # negative: not sustained
        return cache[k] >= target

    def result(k: int | None) -> Goodput:
        return Goodput(goodput_rps=0.0 if k is None else guess * step ** -k, simulations=len(cache),
                       attainment_by_rate={f"{guess * step ** -j:.4g}": a for j, a in sorted(cache.items())})

    ok, bad, jump = (0, None, 1) if passes(0) else (None, 0, 1)
    while ok is None or bad is None:  # gallop: double the jump until the other side is found
        if len(cache) >= max_runs:
            return result(ok)
        k = (ok - jump) if bad is None else (bad + jump)  # type: ignore[operator]
        if passes(k):
            ok = k if ok is None or k < ok else ok
        else:
            bad = k if bad is None or k > bad else bad
        jump *= 2
    while ok - bad > 1 and len(cache) < max_runs:  # invariant: ok passes, bad (a higher rate) fails
        mid = (ok + bad) // 2
        if passes(mid):
            ok = mid
        else:
            bad = mid
    return result(ok)
