"""The worker server: one process = one instance (FastAPI).

`POST /internal/run` runs a contiguous run of a request's stages (triptych/stage_protocol.py)
and streams NDJSON events back to the router. Before the engine sees the request, the
server pulls what earlier stages left elsewhere (HydraInfer §4.3, steps 2-4): image
embeddings into this instance's MM cache, or a prefilled KV cache into its KV cache.
When this instance's last stage ends before decode completes, it parks the request and
offers the blocks under a lease: the next instance pulls them and notifies, and only
then are they freed (or when the lease expires).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel

from triptych.stage_protocol import (
    EncodedEvent,
    EncodedItem,
    ErrorEvent,
    FinishedEvent,
    KVSource,
    MMSource,
    PrefilledEvent,
    RoleSwitch,
    StageRequest,
    TokensEvent,
)
from triptych.topology import UNASSIGNED, InstanceType, Stage
from triptych.worker.engine.engine import Engine, EngineConfig
from triptych.worker.engine.request import (
    PrefilledKV,
    Request,
    RequestOutput,
    RequestValidationError,
)
from triptych.worker.transfer import LeaseTable, TransferEngine, TransferError, run_lease_pump
from triptych.worker.transfer.base import registry_metric

log = logging.getLogger("triptych.worker.server")

MIGRATION_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_migration_seconds",
    "Time to pull a request's blocks from the previous stage's instance (EP: embeddings, PD: KV)",
    ["kind", "transport"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
STAGE_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_stage_seconds",
    "Per-request stage latency on this instance (HydraInfer §5.5 breakdown)", ["role", "stage", "phase"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


class _InstanceCollector(Collector):
    """Queue depths and cache occupancy, read from the engine at scrape time."""

    def __init__(self, instance: InstanceRuntime) -> None:
        self.instance = instance

    def collect(self):  # type: ignore[no-untyped-def]
        inst = self.instance
        labels = ["instance", "role"]
        values = [inst.settings.instance_id, inst.role]
        queue = GaugeMetricFamily("triptych_worker_requests", "Requests on this instance by state",
                                  labels=[*labels, "state"])
        blocks = GaugeMetricFamily("triptych_worker_cache_blocks", "Cache blocks by cache and state",
                                   labels=[*labels, "cache", "state"])
        leases = GaugeMetricFamily("triptych_worker_leases_outstanding", "Hand-overs not yet pulled",
                                   labels=labels)
        leases.add_metric(values, inst.leases.outstanding())
        if inst.engine is not None:
            stats = inst.engine.stats()
            for state in ("waiting", "running", "parked"):
                queue.add_metric([*values, state], stats[f"num_{state}"])
            for cache in ("kv_cache", "mm_cache"):
                for state in ("used", "free", "referenced"):
                    if cache in stats and state in stats[cache]:
                        blocks.add_metric([*values, cache.removesuffix("_cache"), state], stats[cache][state])
        yield queue
        yield blocks
        yield leases


class WorkerSettings(BaseModel):
    model: str
    role: str = UNASSIGNED
    instance_id: str = "worker"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    num_mm_blocks: int | None = None
    transfer_require: Literal["any", "nixl"] = "any"
    lease_seconds: float = 30.0
    pull_timeout_s: float = 20.0  # below lease_seconds: the source must not free mid-READ
    drain_timeout_s: float = 60.0
    max_model_len: int | None = None
    token_budget: int | None = None
    image_budget: int | None = None
    ttft_slo_s: float | None = None  # budgets from the SLO by start-up profiling (profiler.py)
    tbt_slo_s: float | None = None


def settings_from_serving_config(path: str) -> dict[str, Any]:
    """Engine settings from the operator's serving config (the ConfigMap file named by
    TRIPTYCH_CONFIG): context length, block size, and fixed budgets or SLO-derived ones."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    model, slo, sched = config.get("model", {}), config.get("slo", {}), config.get("scheduling", {})
    out: dict[str, Any] = {}
    if model.get("maxModelLen"):
        out["max_model_len"] = int(model["maxModelLen"])
    if model.get("dtype"):
        out["dtype"] = str(model["dtype"])
    if sched.get("blockSize"):
        out["block_size"] = int(sched["blockSize"])
    if sched.get("budgets") == "Fixed":
        out.update(token_budget=sched.get("tokenBudget"), image_budget=sched.get("imageBudget"))
    elif slo:
        out.update(ttft_slo_s=slo.get("ttftMs", 2000) / 1000, tbt_slo_s=slo.get("tbtMs", 200) / 1000)
    return out


class InstanceRuntime:
    """The engine and transfer engine of the current role; swapped whole on a role switch."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.role: str = UNASSIGNED
        self.engine: Engine | None = None
        self.transfer: TransferEngine | None = None
        self.leases = LeaseTable()
        self.loading = False
        self.draining = False
        self.inflight = 0
        self.transfer_bytes: dict[str, int] = {}
        self._pump: asyncio.Task[None] | None = None
        self._switch_lock = asyncio.Lock()

    # -- role --------------------------------------------------------------------------
    def _build(self, role: InstanceType) -> tuple[Engine, TransferEngine]:
        s = self.settings
        engine = Engine(EngineConfig(model=s.model, role=role, dtype=s.dtype, device=s.device,
                                     block_size=s.block_size, num_kv_blocks=s.num_kv_blocks,
                                     num_mm_blocks=s.num_mm_blocks, max_model_len=s.max_model_len,
                                     token_budget=s.token_budget, image_budget=s.image_budget,
                                     ttft_slo_s=s.ttft_slo_s, tbt_slo_s=s.tbt_slo_s))
        transfer = TransferEngine(f"{s.instance_id}-{role.value}", require=s.transfer_require)
        if engine.kv is not None:
            transfer.register("kv", engine.kv.tensor)
        if engine.mm is not None:
            transfer.register("mm", engine.mm.tensor)
        engine.start()
        return engine, transfer

    async def switch(self, role: str) -> None:
        """Drain in-flight work, drop the old engine, load what `role` needs."""
        async with self._switch_lock:
            if role == self.role:
                return
            self.draining = True
            try:
                await self._drain()
                self._teardown()
                if role != UNASSIGNED:
                    self.loading = True
                    engine, transfer = await asyncio.to_thread(self._build, InstanceType(role))
                    self.engine, self.transfer = engine, transfer
                    self._pump = asyncio.create_task(run_lease_pump(transfer, self.leases))
                self.role = role
                log.info("instance %s now serves role %s", self.settings.instance_id, role)
            finally:
                self.loading = False
                self.draining = False

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while (self.inflight or self.leases.outstanding()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.leases.outstanding():
            log.warning("drain timed out with %d leases outstanding; freeing them", self.leases.outstanding())
            self.leases.expire(now=float("inf"))

    def _teardown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None

    # -- views -------------------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.loading:
            return "loading"
        if self.draining:
            return "draining"
        return "ok" if self.engine is not None else "unassigned"

    def load(self) -> float:
        if self.engine is None:
            return 0.0
        stats = self.engine.stats()
        return float(stats["num_waiting"] + stats["num_running"])

    def stats(self) -> dict[str, Any]:
        base: dict[str, Any] = {"role": self.role, "instance_id": self.settings.instance_id,
                                "status": self.status, "inflight": self.inflight,
                                "leases_outstanding": self.leases.outstanding(),
                                "transport": self.transfer.transport if self.transfer else None,
                                "transfer_bytes": dict(self.transfer_bytes)}
        if self.engine is not None:
            base.update(self.engine.stats())
        return base


class StageError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


# -- the stage run ------------------------------------------------------------------------
async def _pull(inst: InstanceRuntime, handle: dict[str, Any], region: str, block_ids: list[int], kind: str) -> None:
    assert inst.transfer is not None
    started = time.monotonic()
    try:
        nbytes = await asyncio.to_thread(inst.transfer.pull, handle, region, block_ids,
                                         timeout_s=inst.settings.pull_timeout_s)
    except TransferError as exc:
        raise StageError(502, f"pulling {kind} blocks failed: {exc}") from exc
    MIGRATION_SECONDS.labels(kind=kind, transport=inst.transfer.transport).observe(time.monotonic() - started)
    inst.transfer_bytes[inst.transfer.transport] = inst.transfer_bytes.get(inst.transfer.transport, 0) + nbytes


async def _pull_embeddings(inst: InstanceRuntime, sources: list[MMSource]) -> list[Any]:
    """Pull each embedding into this MM cache (skipping ones it holds); returns entries to
    release once the request holds its own references."""
    engine = inst.engine
    assert engine is not None and engine.mm is not None
    reserved = []
    try:
        for src in sources:
            held = engine.acquire_mm(src.content_hash)
            if held is not None:
                reserved.append(held)
                await _pull(inst, {**src.handle, "block_ids": []}, "mm", [], "ep")  # confirm only
                continue
            entry = engine.reserve_mm(src.content_hash, src.num_tokens)
            reserved.append(entry)
            await _pull(inst, src.handle, "mm", entry.block_ids, "ep")
            engine.commit_mm(entry)
    except BaseException:
        for entry in reserved:
            engine.release_mm(entry)
        raise
    return reserved


async def _pull_kv(inst: InstanceRuntime, src: KVSource) -> PrefilledKV:
    engine = inst.engine
    assert engine is not None
    block_ids = engine.reserve_kv(src.num_tokens)
    try:
        await _pull(inst, src.handle, "kv", block_ids, "pd")
    except BaseException:
        engine.free_kv(block_ids)
        raise
    return PrefilledKV(block_ids=block_ids, num_tokens=src.num_tokens, first_token=src.first_token)


def _offer(inst: InstanceRuntime, request_id: str, region: str, groups: list[list[int]]) -> list[str]:
    """One lease per hand-over group; the parked request is released when all are done."""
    engine, remaining = inst.engine, [len(groups)]
    lock = threading.Lock()

    def release_one() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last and engine is not None:
            engine.release(request_id)

    return [inst.leases.offer(region, ids, release_one, inst.settings.lease_seconds) for ids in groups]


def _events_for(inst: InstanceRuntime, sreq: StageRequest, out: RequestOutput, skip: int) -> list[BaseModel]:
    assert inst.transfer is not None
    if out.error:  # bad input was refused at add_request (400); what fails later is ours
        return [ErrorEvent(status=503 if "exhausted" in out.error else 500, message=out.error)]
    handoff = out.handoff
    if handoff is not None and handoff.stage == Stage.ENCODE:
        leases = _offer(inst, sreq.request_id, "mm", [ids for _, ids, _ in handoff.mm])
        return [EncodedEvent(items=[
            EncodedItem(content_hash=h, num_tokens=rows,
                        handle=inst.transfer.handle("mm", ids, lease).model_dump(mode="json"))
            for (h, ids, rows), lease in zip(handoff.mm, leases, strict=True)])]
    if handoff is not None and handoff.stage == Stage.PREFILL:
        (lease,) = _offer(inst, sreq.request_id, "kv", [handoff.kv_block_ids])
        handle = inst.transfer.handle("kv", handoff.kv_block_ids, lease).model_dump(mode="json")
        assert handoff.first_token is not None
        return [PrefilledEvent(kv=KVSource(handle=handle, num_tokens=handoff.num_kv_tokens,
                                           first_token=handoff.first_token))]
    events: list[BaseModel] = []
    tokens = out.new_token_ids[skip:]
    if tokens:
        events.append(TokensEvent(token_ids=tokens))
    if out.finished:
        reason = out.finish_reason.value if out.finish_reason else "abort"
        events.append(FinishedEvent(finish_reason=reason, timings=out.timings or {}))
    return events


def stage_breakdown(stages: set[Stage], t: dict[str, float]) -> dict[tuple[str, str], float]:
    """Per-stage queue and exec seconds of one request on this instance (HydraInfer §5.5's
    latency breakdown; the migrations are timed where the pulls happen)."""
    out: dict[tuple[str, str], float] = {}
    arrival = t.get("arrival", 0.0)
    if "encode_start" in t:
        out["encode", "queue"] = t["encode_start"] - arrival
        if "encode_end" in t:
            out["encode", "exec"] = t["encode_end"] - t["encode_start"]
    if "prefill_start" in t:
        out["prefill", "queue"] = t["prefill_start"] - max(arrival, t.get("encode_end", arrival))
        if "prefill_end" in t:
            out["prefill", "exec"] = t["prefill_end"] - t["prefill_start"]
    if Stage.DECODE in stages and "finished" in t:
        if Stage.PREFILL not in stages and "first_scheduled" in t:
            out["decode", "queue"] = t["first_scheduled"] - arrival
        begin = t.get("prefill_end", t.get("first_scheduled"))
        if begin is not None:
            out["decode", "exec"] = t["finished"] - begin
    return {k: max(0.0, v) for k, v in out.items()}


def _observe(role: str, stages: set[Stage], timings: dict[str, float]) -> None:
    for (stage, phase), seconds in stage_breakdown(stages, timings).items():
        STAGE_SECONDS.labels(role=role, stage=stage, phase=phase).observe(seconds)


async def _prepare(inst: InstanceRuntime, sreq: StageRequest) -> tuple[Request, list[Any]]:
    engine = inst.engine
    if engine is None or inst.draining:
        raise StageError(503, f"instance {inst.settings.instance_id} is {inst.status}; not accepting work")
    missing = [s.value for s in sreq.stages if not engine.role.runs(s)]
    if missing:
        raise StageError(503, f"instance role {engine.role.value} does not run stage(s) {', '.join(missing)}")
    try:
        images = {h: base64.b64decode(data, validate=True) for h, data in sreq.images.items()}
    except ValueError as exc:
        raise StageError(400, f"image payload is not base64: {exc}") from exc
    reserved = await _pull_embeddings(inst, sreq.mm_sources) if sreq.mm_sources else []
    prefilled = await _pull_kv(inst, sreq.kv_source) if sreq.kv_source is not None else None
    req = Request(sreq.request_id, sreq.prompt_token_ids, sreq.sampling, mm_items=sreq.mm_items,
                  images=images, stages=frozenset(sreq.stages), prefilled=prefilled)
    return req, reserved


async def _stream(inst: InstanceRuntime, sreq: StageRequest, req: Request, reserved: list[Any]) -> AsyncIterator[bytes]:
    engine = inst.engine
    assert engine is not None
    skip = 1 if req.prefilled is not None else 0  # token 1 was sampled (and streamed) by P
    inst.inflight += 1
    try:
        async for out in engine.generate(req, timeout_s=sreq.timeout_s):
            if reserved:  # the request now holds its own references to pulled embeddings
                for entry in reserved:
                    engine.release_mm(entry)
                reserved = []
            for event in _events_for(inst, sreq, out, skip):
                yield (event.model_dump_json() + "\n").encode()
            skip = max(0, skip - len(out.new_token_ids))
            if out.finished and out.timings:
                _observe(engine.role.value, set(sreq.stages), out.timings)
    except RequestValidationError as exc:
        yield (ErrorEvent(status=400, message=str(exc)).model_dump_json() + "\n").encode()
    except TimeoutError:
        yield (ErrorEvent(status=504, message=f"request exceeded {sreq.timeout_s}s").model_dump_json()
               + "\n").encode()
    finally:
        for entry in reserved:
            engine.release_mm(entry)
        inst.inflight -= 1


# -- the app ------------------------------------------------------------------------------
def create_app(settings: WorkerSettings) -> FastAPI:
    inst = InstanceRuntime(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        collector = _InstanceCollector(inst)
        REGISTRY.register(collector)
        if settings.role != UNASSIGNED:
            await inst.switch(settings.role)
        yield
        inst._teardown()
        REGISTRY.unregister(collector)

    app = FastAPI(title="triptych worker", lifespan=lifespan)
    app.state.instance = inst

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": inst.status, "role": inst.role, "instance_id": settings.instance_id,
                "load": inst.load(), "draining": inst.draining,
                "transport": inst.transfer.transport if inst.transfer else None}
        return JSONResponse(body, status_code=200 if inst.status in ("ok", "unassigned") else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = inst.status in ("ok", "unassigned")
        return JSONResponse({"ready": ok, "role": inst.role}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/stats")
    async def admin_stats() -> dict[str, Any]:
        return inst.stats()

    @app.post("/admin/role")
    async def admin_role(body: RoleSwitch) -> JSONResponse:
        if body.role != UNASSIGNED and body.role not in InstanceType.__members__:
            return _error(400, f"unknown role {body.role!r}; expected one of "
                               f"{', '.join(t.value for t in InstanceType)} or {UNASSIGNED}")
        try:
            await inst.switch(body.role)
        except Exception as exc:  # a failed load leaves the instance unassigned, and says why
            log.exception("role switch to %s failed", body.role)
            inst.role = UNASSIGNED
            return _error(500, f"switching to {body.role} failed: {exc}")
        return JSONResponse({"role": inst.role, "status": inst.status})

    @app.post("/internal/run")
    async def run(sreq: StageRequest) -> Response:
        try:
            req, reserved = await _prepare(inst, sreq)
        except StageError as exc:
            return _error(exc.status, exc.message)
        except RequestValidationError as exc:
            return _error(400, str(exc))
        return StreamingResponse(_stream(inst, sreq, req, reserved), media_type="application/x-ndjson")

    @app.post("/internal/abort/{request_id}")
    async def abort(request_id: str) -> dict[str, str]:
        if inst.engine is not None:
            inst.engine.abort(request_id)
        return {"aborted": request_id}

    @app.exception_handler(RequestValidationError)
    async def invalid(_req: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return _error(400, str(exc))

    return app


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT drain first: the instance reports `draining` (the router stops routing
    to it), refuses new stage runs with 503, finishes in-flight work and outstanding
    hand-overs (bounded by drain_timeout_s), then exits. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, instance: InstanceRuntime) -> None:
        super().__init__(config)
        self.instance = instance
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None or self.instance.engine is None:
            return super().handle_exit(sig, frame)
        log.info("signal %s: draining before exit", sig)
        self.instance.draining = True
        self._drain_task = asyncio.get_event_loop().create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame: Any) -> None:
        await self.instance._drain()
        # In-flight work is done; what uvicorn may still wait for is an idle keep-alive
        # connection from the router, which must not hold the exit for the full 30 s.
        self.config.timeout_graceful_shutdown = 2
        super().handle_exit(sig, frame)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    threads = args.threads or int(os.environ.get("TRIPTYCH_THREADS", "0")) or None
    if threads:
        torch.set_num_threads(threads)
    from_file = settings_from_serving_config(args.config) if args.config else {}
    flags = {"max_model_len": args.max_model_len, "token_budget": args.token_budget,
             "image_budget": args.image_budget, "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo}
    settings = WorkerSettings(**{
        "dtype": args.dtype, "block_size": args.block_size, **from_file,
        **{k: v for k, v in flags.items() if v is not None},
        "model": str(args.model), "role": args.role,
        "instance_id": args.instance_id or f"{args.role}-{args.port}", "device": args.device,
        "num_kv_blocks": args.num_kv_blocks, "num_mm_blocks": args.num_mm_blocks,
        "transfer_require": args.transfer_require, "lease_seconds": args.lease_seconds,
        "pull_timeout_s": min(20.0, args.lease_seconds * 0.66)})
    app = create_app(settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=30)
    DrainingServer(config, app.state.instance).run()
    return 0
