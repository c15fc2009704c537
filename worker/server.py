"""The worker server: one process = one instance (FastAPI). Only the HTTP surface lives
here: the instance's role lifecycle is instance.py, a stage run (and the migration pulls
and offers around it) is stage_run.py, statuses come from errors.py.

Endpoints: `POST /internal/run` runs a contiguous run of a request's stages and streams
NDJSON events back to the router; `POST /internal/takeover` runs a decode moving here
mid-stream (pre-copy, then its hand-over; worker/takeover.py); `POST /internal/channel` holds
a router's event channel open, which runs posted with its header stream on instead
(worker/stage_channel.py), and `POST /internal/channel/{id}/cancel/{tag}` stops one of them;
`POST /internal/abort/{id}` (all need the internal token); `/admin/role`, `/admin/stats`, `/admin/timings` (the admin token; auth.py); `/health`, `/ready`,
`/live`, `/metrics` (open, and free of secrets: no agent metadata, handles or leases).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from triptych.listen_socket import adopt
from triptych.stage_protocol import (
    CHANNEL_GONE,
    CHANNEL_HEADER,
    CHANNEL_PATH,
    STAGE_FRAME_TYPE,
    WORKER_KEEPALIVE_TIMEOUT_S,
    FeedBatch,
    FeedReply,
    RoleSwitch,
    StageFrameError,
    StageRequest,
    decode_stage_request,
    ndjson_lines,
)
from triptych.timings import TIMINGS, TimingsPage
from triptych.topology import UNASSIGNED, InstanceType
from triptych.worker import choices, takeover
from triptych.worker.auth import AuthMiddleware, MissingTokenError, WorkerAuth
from triptych.worker.draining import DrainingServer
from triptych.worker.engine.request import RequestValidationError
from triptych.worker.errors import BadPayloadError, NotServingError, OverloadedError, error_code, http_status
from triptych.worker.instance import InstanceRuntime
from triptych.worker.metrics import InstanceCollector
from triptych.worker.migration import MigrationError
from triptych.worker.settings import WorkerSettings, settings_from_args
from triptych.worker.stage_channel import Channel, Channels
from triptych.worker.stage_run import prepare, stream

log = logging.getLogger("triptych.worker.server")

# Failures a stage run may raise before its stream starts; each maps to a status in errors.py.
_PARSE_INLINE_BYTES = 256 << 10  # stage requests below this parse in well under a millisecond
_REFUSALS = (RequestValidationError, BadPayloadError, NotServingError, OverloadedError, MigrationError)


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": code or status}}, status_code=status)


def _invalid(what: str, exc: ValidationError) -> JSONResponse:
    """A body that does not parse as `what`: 422, with its first error."""
    return _error(422, f"invalid {what}: {exc.error_count()} error(s): {exc.errors()[0]['msg']}")


def create_app(settings: WorkerSettings, auth: WorkerAuth) -> FastAPI:
    """The worker app; `auth` guards /internal and /admin (WorkerAuth.open() for none)."""
    inst = InstanceRuntime(settings)
    channels = Channels()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        collector = InstanceCollector(inst)
        REGISTRY.register(collector)
        if settings.role != UNASSIGNED:
            await inst.switch(settings.role)
        yield
        inst.teardown()
        inst.decode_pool.close()
        REGISTRY.unregister(collector)

    app = FastAPI(title="triptych worker", lifespan=lifespan)
    app.state.instance = inst
    app.state.channels = channels
    app.add_middleware(AuthMiddleware, auth=auth)

    @app.get("/live")
    async def live() -> dict[str, bool]:
        # Liveness only: the process answers. 200 while loading, draining or switching
        # roles too, so a slow switch never gets the container killed.
        return {"live": True}

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": inst.status, "role": inst.role, "instance_id": settings.instance_id,
                "load": inst.load(), "draining": inst.draining, "transport": inst.transport,
                "target_role": inst.target_role, "block_size": settings.block_size,
                "dtype": settings.dtype}
        return JSONResponse(body, status_code=200 if inst.status in ("ok", "unassigned") else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        # Ready = serving a role. An unassigned worker is alive (/live) but holds no capacity,
        # so Kubernetes keeps it out of endpoints until the operator gives it a role.
        ok = inst.status == "ok"
        return JSONResponse({"ready": ok, "role": inst.role}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/stats")
    async def admin_stats() -> dict[str, Any]:
        return inst.stats()

    @app.get("/admin/timings")
    async def admin_timings(since: int = 0) -> TimingsPage:
        # Exact recent migration timings of this process (triptych/timings.py; bench serve).
        return TIMINGS.page(since)

    @app.post("/admin/role")
    async def admin_role(body: RoleSwitch) -> JSONResponse:
        if body.role != UNASSIGNED and body.role not in InstanceType.__members__:
            return _error(400, f"unknown role {body.role!r}; expected one of "
                               f"{', '.join(t.value for t in InstanceType)} or {UNASSIGNED}")
        if body.role == InstanceType.V.value:  # a video decoder is its own process (no engine)
            return _error(409, "V (video decode) is not a role an engine instance switches to; start a "
                               "worker with --role V")
        try:
            report = await inst.switch(body.role)
        except Exception as exc:  # a failed load leaves the instance unassigned, and says why
            log.exception("role switch to %s failed", body.role)
            inst.role = UNASSIGNED
            return _error(500, f"switching to {body.role} failed: {exc}")
        return JSONResponse({"role": inst.role, "status": inst.status, **report})

    @app.post(CHANNEL_PATH)
    async def channel(id: str) -> Response:
        opened = channels.open(id)
        if opened is None:
            return _error(409, f"event channel {id!r} is already open")
        return StreamingResponse(opened.body(), media_type="application/x-ndjson")

    @app.post(CHANNEL_PATH + "/{cid}/cancel/{tag}")
    async def channel_cancel(cid: str, tag: str) -> Response:
        found = channels.get(cid)
        return Response(status_code=204 if found is not None and found.cancel(tag) else 404)

    @app.post("/internal/run")
    async def run(http: HttpRequest) -> Response:
        attach: tuple[Channel, str] | None = None
        if header := http.headers.get(CHANNEL_HEADER):
            cid, _, tag = header.partition(" ")
            found = channels.get(cid)
            if found is None or not tag:  # the router sends this run as its own stream, then reopens
                return _error(503, f"no event channel {cid!r} open on this instance", CHANNEL_GONE)
            attach = (found, tag)
        # A large body (several big images: tens of MB) is parsed off the event loop, which
        # would otherwise stall (and /health with it) for as long as copying it out takes.
        body = await http.body()
        framed = http.headers.get("content-type", "").partition(";")[0].strip() == STAGE_FRAME_TYPE
        parse = decode_stage_request if framed else StageRequest.model_validate_json  # JSON: no images
        try:
            sreq = parse(body) if len(body) < _PARSE_INLINE_BYTES else await asyncio.to_thread(parse, body)
        except ValidationError as exc:
            return _invalid("stage request", exc)
        except StageFrameError as exc:
            return _error(422, f"invalid stage request frame: {exc}")
        return await _start(sreq, attach)

    async def _start(sreq: StageRequest, attach: tuple[Channel, str] | None = None) -> Response:
        """Pull the run's inputs and stream its events, in the answer or on `attach`'s
        channel under its tag (or refuse it)."""
        try:
            req, reserved = await prepare(inst, sreq)
        except _REFUSALS as exc:
            return _error(http_status(exc), str(exc), error_code(exc))
        if sreq.sampling.n > 1:
            events = choices.stream(inst, sreq, req, reserved)
        else:
            events = stream(inst, sreq, req, reserved, attach[0].writer(attach[1]) if attach else None)
        if attach is None:
            return StreamingResponse(events, media_type="application/x-ndjson")
        # A channel that closed while the inputs were pulled drops the run's events; the
        # run still ends (and frees what it holds) as a run with a vanished reader does.
        attach[0].attach(attach[1], events)
        return JSONResponse({"channel": attach[0].cid, "tag": attach[1]})

    @app.post("/internal/takeover")
    async def takeover_run(http: HttpRequest) -> Response:
        # A decode moving here mid-stream (worker/takeover.py): pre-copy, then its hand-over.
        try:
            sreq = await takeover.receive(inst, ndjson_lines(http.stream()))
        except (BadPayloadError, ClientDisconnect) as exc:
            return _error(400, f"takeover: {exc}")
        response = await _start(sreq)
        if not isinstance(response, StreamingResponse):  # refused: no run will take its feed
            inst.feeds.pop(sreq.request_id, None)
        return response

    @app.post("/internal/feed")
    async def feed(http: HttpRequest) -> Response:
        # Tokens takeovers' sources sampled after a live hand-over (worker/takeover.py).
        try:
            body = FeedBatch.model_validate_json(await http.body())
        except ValidationError as exc:
            return _invalid("feeds", exc)
        taken = [takeover.feed(inst, f, batch=len(body.feeds)) for f in body.feeds]
        return Response(FeedReply(taken=taken).model_dump_json(), media_type="application/json")

    @app.post("/internal/abort/{request_id}")
    async def abort(request_id: str) -> dict[str, str]:
        inst.abort(request_id)
        return {"aborted": request_id}

    @app.exception_handler(RequestValidationError)
    async def invalid(_req: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return _error(http_status(exc), str(exc))

    return app


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The event loop shares the GIL with the decode pool and the engine thread; each time it
    # wakes (a /health probe: accept, read, write) it may wait a full switch interval for
    # a busy thread to let go. 1 ms instead of 5 keeps probes fast while images decode.
    sys.setswitchinterval(0.001)
    threads = args.threads or int(os.environ.get("TRIPTYCH_THREADS", "0")) or None
    if threads:
        torch.set_num_threads(threads)
    settings = settings_from_args(args)
    try:
        auth = WorkerAuth.load(args.internal_token_file, args.admin_token_file, args.insecure_no_auth)
    except MissingTokenError as exc:
        raise SystemExit(str(exc)) from exc
    if auth.insecure:
        log.warning("--insecure-no-auth: /internal and /admin are open to anyone who can connect")
    app = create_app(settings, auth)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=30, timeout_keep_alive=WORKER_KEEPALIVE_TIMEOUT_S)
    DrainingServer(config, _ClosingChannels(app.state.instance, app.state.channels)).run(sockets=[adopt(args.fd)] if args.fd is not None else None)
    return 0


class _ClosingChannels:
    """The instance as DrainingServer drains it, with the routers' event channels closed
    once nothing is left to drain: open, each would hold uvicorn's shutdown for its grace."""

    def __init__(self, inst: InstanceRuntime, channels: Channels) -> None:
        self.inst = inst
        self.channels = channels

    def begin_drain(self) -> bool:
        draining = self.inst.begin_drain()
        if not draining:
            self.channels.close_all()
        return draining

    async def drain(self) -> None:
        await self.inst.drain()
        self.channels.close_all()
