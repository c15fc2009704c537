"""Fake workers for the orchestrator's in-process tests.

Each fake is a small FastAPI app speaking the real stage protocol
(triptych/stage_protocol.py) — `POST /internal/run` answering NDJSON events,
`POST /internal/abort/{id}`, `GET /health` — served by uvicorn on loopback inside the
test's event loop, so the orchestrator's real httpx client, timeouts and connection
handling are exercised. A fake follows the protocol's rules the way a worker does:

- a run that ends in a hand-over (`encoded`, `prefilled`) parks its id until a peer pulls
  the hand-over (the NIXL notification, done here by the cluster) or it is aborted;
- a run under an id in use (running or parked) is refused with a 400 error event, as the
  engine refuses it;
- a prefill must have every image's embedding (encoded in the same run, or pulled), and a
  decode without prefill must have a KV source: otherwise a 500 error event.

Its "model" answers `expected_tokens(prompt, max_tokens)`: a prefill samples the first, a
decode continues from the KV source's first token, so the tokens a client sees prove the
handles were carried. Every run and every abort id is recorded; `script()` queues what
the next runs do instead of answering normally (see the step helpers below).

`FakeCluster(..., channels=True)` fakes also hold the router's event channels open, with
the worker's own channel code (worker/stage_channel.py): a run posted with the channel
header streams there, and CRASH closes the run's channel (as a killed worker drops it).

Like a worker, a fake refuses `/internal/*` without the cluster's internal token (the real
worker/auth.py middleware), and the cluster's client is the router's `worker_client`, so
a router call that drops the token fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect

from triptych.processor import MMItem
from triptych.router.backend import GenerationRequest, TokenEvent
from triptych.router.orchestrator import Orchestrator, OrchestratorConfig
from triptych.router.registry import Registry
from triptych.router.routing import Chooser
from triptych.router.stage_client import worker_client
from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import (
    CHANNEL_GONE,
    CHANNEL_HEADER,
    CHANNEL_PATH,
    STAGE_FRAME_TYPE,
    EncodedEvent,
    EncodedItem,
    ErrorEvent,
    FinishedEvent,
    KVSource,
    PrefilledEvent,
    StageEvent,
    StageRequest,
    TokensEvent,
    decode_stage_request,
    ndjson_lines,
)
from triptych.topology import InstanceType, Stage, parse_topology
from triptych.worker.auth import AuthMiddleware, WorkerAuth
from triptych.worker.stage_channel import Channel, Channels

HANG = "hang"  # go silent, keeping the connection open (until the cluster closes, at most HANG_LIMIT_S)
CRASH = "crash"  # drop the connection mid-stream, like a killed process
HANG_LIMIT_S = 30.0  # a fake never hangs longer than this, whatever the test does
IMAGE_TOKENS = 4  # placeholder tokens per image in `request()`
INTERNAL_TOKEN = "fake-internal-token"
ADMIN_TOKEN = "fake-admin-token"

Step = StageEvent | str | asyncio.Event  # an event to send, HANG / CRASH, or a gate to wait for
_EVENTS = (EncodedEvent, TokensEvent, PrefilledEvent, FinishedEvent)  # what a working run sends
# A script sees the run and the events a healthy worker would send; it returns the steps to
# take instead, or an int: answer that HTTP status before streaming anything.
Script = Callable[[StageRequest, list[StageEvent]], list[Step] | int]


# -- step helpers --------------------------------------------------------------------------
def status(code: int) -> Script:
    return lambda sreq, normal: code


def error(code: int = 500, message: str = "injected failure") -> Script:
    return lambda sreq, normal: [ErrorEvent(status=code, message=message)]


def hang_after(count: int = 0) -> Script:
    """Send the first `count` healthy events, then go silent."""
    return lambda sreq, normal: [*normal[:count], HANG]


def crash_after(count: int = 0) -> Script:
    """Send the first `count` healthy events, then drop the connection."""
    return lambda sreq, normal: [*normal[:count], CRASH]


def garbage() -> Script:
    return lambda sreq, normal: ['{"type": "telemetry", "x": 1}']


def gate(event: asyncio.Event) -> Script:
    """Wait for `event`, then answer normally."""
    return lambda sreq, normal: [event, *normal]


def aborted() -> Script:
    return lambda sreq, normal: [FinishedEvent(finish_reason="abort")]


def healthy() -> Script:
    return lambda sreq, normal: normal


# -- requests ---------------------------------------------------------------------------
def request(request_id: str = "req", images: tuple[str, ...] = (), max_tokens: int = 4,
            text_tokens: int = 3) -> GenerationRequest:
    """A GenerationRequest whose prompt holds one placeholder run per image (by content hash)."""
    prompt = list(range(1, text_tokens + 1))
    items = []
    for index, content_hash in enumerate(images):
        items.append(MMItem(kind="image", index=index, offset=len(prompt), length=IMAGE_TOKENS,
                            grid_thw=(1, 4, 4), content_hash=content_hash, width=8, height=8))
        prompt += [7] * IMAGE_TOKENS
    return GenerationRequest(request_id, prompt, items, [f"bytes of {h}".encode() for h in images],
                             SamplingParams(max_tokens=max_tokens, temperature=0.0))


def expected_tokens(req: GenerationRequest) -> list[int]:
    return _answer(req.prompt_token_ids, req.sampling.max_tokens)


def _answer(prompt: list[int], max_tokens: int) -> list[int]:
    return [1000 + len(prompt) + i for i in range(max_tokens)]


async def collect(orch: Orchestrator, req: GenerationRequest) -> tuple[list[int], str | None]:
    """Run one request to the end: all its tokens and its finish reason."""
    tokens: list[int] = []
    reason = None
    async for event in orch.generate(req):
        tokens += event.token_ids
        reason = event.finish_reason or reason
    return tokens, reason


async def first_events(orch: Orchestrator, req: GenerationRequest, count: int) -> list[TokenEvent]:
    """Take `count` events, then leave the way the HTTP layer does: cancel the task iterating."""
    got: list[TokenEvent] = []
    enough = asyncio.Event()

    async def consume() -> None:
        async for event in orch.generate(req):
            got.append(event)
            if len(got) >= count:
                enough.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(enough.wait(), timeout=10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=10)
    return got


# -- one worker -------------------------------------------------------------------------
@dataclass
class Run:
    """One `/internal/run` call as the worker received it, and whether it was scripted."""

    request: StageRequest
    scripted: bool

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def stages(self) -> list[str]:
        return [s.value for s in self.request.stages]


class FakeWorker:
    def __init__(self, name: str, role: InstanceType, cluster: FakeCluster, channels: bool = False) -> None:
        self.name = name
        self.channels = Channels() if channels else None
        self.channels_opened = 0
        self.cancels: list[str] = []  # run tags the router cancelled on a channel
        self.role = role
        self.cluster = cluster
        self.url = ""
        self.load = 0.0
        self.runs: list[Run] = []
        self.aborts: list[str] = []
        self.running: set[str] = set()
        self.parked: set[str] = set()  # ids holding a hand-over nobody pulled yet
        self.scripts: deque[Script] = deque()
        # Takeovers (router/takeover.py): the first line of each, whether its hand-over came,
        # and the status to answer one with instead of running it (None: run it).
        self.takeovers: list[tuple[StageRequest, bool]] = []
        self.takeover_status: int | None = None
        self.takeovers_opened = 0  # takeover calls that reached this fake (before reading their body)
        self.app = self._build_app()

    def script(self, *scripts: Script) -> None:
        """The next runs (one script each, in order) do this; later ones answer normally."""
        self.scripts.extend(scripts)

    def encoded(self) -> list[str]:
        """Content hashes this worker was asked to encode, over all runs."""
        return [h for run in self.runs for h in run.request.images]

    # -- the protocol -------------------------------------------------------------------
    def normal_events(self, sreq: StageRequest) -> list[StageEvent]:
        """What a healthy worker of this role streams for the run."""
        stages = sreq.stages
        if any(not self.role.runs(s) for s in stages):
            return [ErrorEvent(status=400, message=f"{self.name} ({self.role}) cannot run {stages}")]
        local = set(sreq.images) if Stage.ENCODE in stages else set()
        if Stage.PREFILL in stages:
            pulled = {s.content_hash for s in sreq.mm_sources}
            missing = {m.content_hash for m in sreq.mm_items} - local - pulled
            if missing:
                return [ErrorEvent(status=500, message=f"no embedding for {sorted(missing)}")]
        handle = {"agent": self.name, "request_id": sreq.request_id}
        if stages[-1] is Stage.ENCODE:
            rows = {m.content_hash: m.length for m in sreq.mm_items}
            return [EncodedEvent(items=[EncodedItem(content_hash=h, num_tokens=rows[h], handle=handle)
                                        for h in sreq.images])]
        answer = _answer(sreq.prompt_token_ids, sreq.sampling.max_tokens)
        if stages[-1] is Stage.PREFILL:
            return [PrefilledEvent(kv=KVSource(handle=handle, num_tokens=len(sreq.prompt_token_ids),
                                               first_token=answer[0]))]
        if Stage.PREFILL not in stages:
            if sreq.kv_source is None:
                return [ErrorEvent(status=500, message="decode without a KV source")]
            answer = answer[answer.index(sreq.kv_source.first_token) + 1:]  # token 1 came from P
        return [*(TokensEvent(token_ids=[t]) for t in answer), FinishedEvent(finish_reason="length")]

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        app.add_middleware(AuthMiddleware, auth=WorkerAuth(INTERNAL_TOKEN, ADMIN_TOKEN))

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok", "role": self.role.value, "instance_id": self.name, "load": self.load,
                    "draining": False}

        @app.post("/internal/abort/{request_id}")
        async def abort(request_id: str) -> dict:
            self.aborts.append(request_id)
            self.parked.discard(request_id)
            return {"aborted": request_id}

        @app.post("/internal/takeover")
        async def takeover(http: Request) -> Response:
            self.takeovers_opened += 1
            lines = ndjson_lines(http.stream())
            first = StageRequest.model_validate_json(await anext(lines))
            try:
                tail = KVSource.model_validate_json(await anext(lines))
            except (StopAsyncIteration, ClientDisconnect):
                self.takeovers.append((first, False))
                return JSONResponse({"error": {"message": "no hand-over"}}, status_code=400)
            self.takeovers.append((first, True))
            if self.takeover_status is not None:
                return JSONResponse({"error": {"message": f"{self.name} answers {self.takeover_status}"}},
                                    status_code=self.takeover_status)
            return respond(first.model_copy(update={"kv_source": tail}))

        if self.channels is not None:
            channels = self.channels

            @app.post(CHANNEL_PATH)
            async def channel(id: str) -> Response:
                opened = channels.open(id)
                assert opened is not None, "a router opened a channel id twice"
                self.channels_opened += 1
                return StreamingResponse(opened.body(), media_type="application/x-ndjson")

            @app.post(CHANNEL_PATH + "/{cid}/cancel/{tag}")
            async def cancel(cid: str, tag: str) -> Response:
                self.cancels.append(tag)
                found = channels.get(cid)
                return Response(status_code=204 if found is not None and found.cancel(tag) else 404)

        @app.post("/internal/run")
        async def run(http: Request) -> Response:
            assert http.headers.get("content-type") == STAGE_FRAME_TYPE  # what a worker reads
            header = http.headers.get(CHANNEL_HEADER)
            attach = None
            if header is not None:
                assert self.channels is not None, "a run posted for a channel this fake never offered"
                cid, _, tag = header.partition(" ")
                found = self.channels.get(cid)
                if found is None:
                    return JSONResponse({"error": {"message": "no such channel", "code": CHANNEL_GONE}},
                                        status_code=503)
                attach = (found, tag)
            return respond(decode_stage_request(await http.body()), attach)

        def respond(sreq: StageRequest, attach: tuple[Channel, str] | None = None) -> Response:
            script = self.scripts.popleft() if self.scripts else None
            self.runs.append(Run(sreq, scripted=script is not None))
            if sreq.request_id in self.running | self.parked:
                steps: list[Step] | int = [ErrorEvent(status=400, message=f"request id {sreq.request_id!r} "
                                                                          "is already in use")]
            else:
                normal = self.normal_events(sreq)
                steps = script(sreq, normal) if script is not None else normal
            if isinstance(steps, int):
                return JSONResponse({"error": {"message": f"{self.name} answers {steps}"}}, status_code=steps)
            if any(isinstance(s, _EVENTS) for s in steps):  # it got as far as pulling its inputs
                self.cluster.pulled(sreq)
            if attach is not None:
                attach[0].attach(attach[1], self._stream(sreq.request_id, steps, attach[0]))
                return JSONResponse({"channel": attach[0].cid, "tag": attach[1]})
            return StreamingResponse(self._stream(sreq.request_id, steps), media_type="application/x-ndjson")

        return app

    async def _stream(self, request_id: str, steps: list[Step], channel: Channel | None = None
                      ) -> AsyncIterator[bytes]:
        self.running.add(request_id)
        try:
            for step in steps:
                if isinstance(step, asyncio.Event):
                    await asyncio.wait_for(step.wait(), timeout=HANG_LIMIT_S)
                    continue
                if step == HANG:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.cluster.closing.wait(), timeout=HANG_LIMIT_S)
                    return
                if step == CRASH and channel is not None:
                    channel.close()  # the whole channel goes, as with a killed worker
                    return
                if step == CRASH:
                    raise ConnectionAbortedError(f"{self.name} crashed")  # uvicorn drops the connection
                if isinstance(step, str):
                    yield (step + "\n").encode()
                    continue
                if isinstance(step, EncodedEvent | PrefilledEvent):
                    self.parked.add(request_id)
                yield (step.model_dump_json() + "\n").encode()
                await asyncio.sleep(0)  # one event per chunk, as a worker streams them
        finally:
            self.running.discard(request_id)


# -- a deployment of fakes -------------------------------------------------------------
class FakeCluster:
    """Fakes for a topology (`"2E1P1D"` -> e0, e1, p0, d0), each on its own loopback port,
    plus the registry and HTTP client an orchestrator needs. Use as `async with`.

    URLs sort in name order, so the round-robin choices of a test are known in advance
    (the chooser orders candidates by URL)."""

    def __init__(self, topology: str, channels: bool = False) -> None:
        self.workers: dict[str, FakeWorker] = {}
        for kind, count in parse_topology(topology).items():
            for i in range(count):
                name = f"{kind.value.lower()}{i}"
                self.workers[name] = FakeWorker(name, kind, self, channels)
        self._servers: list[tuple[_Server, asyncio.Task]] = []
        self.client = worker_client(INTERNAL_TOKEN)
        self.registry = Registry([])
        self.metrics = CollectorRegistry()
        self.closing = asyncio.Event()

    def __getitem__(self, name: str) -> FakeWorker:
        return self.workers[name]

    def by_url(self, url: str) -> FakeWorker:
        return next(w for w in self.workers.values() if w.url == url)

    def orchestrator(self, chooser: Chooser | None = None, **config: object) -> Orchestrator:
        """An orchestrator over the fakes; its metrics go to `self.metrics`."""
        self.metrics = CollectorRegistry()
        return Orchestrator(self.registry, self.client, chooser or Chooser(), OrchestratorConfig(**config),
                            self.metrics)

    def decisions(self, stage: str, outcome: str) -> float:
        """`triptych_frontend_routing_decisions_total` for a stage and outcome, over policies."""
        return sum(s.value for m in self.metrics.collect() for s in m.samples
                   if s.name == "triptych_frontend_routing_decisions_total"
                   and s.labels["stage"] == stage and s.labels["outcome"] == outcome)

    def pulled(self, sreq: StageRequest) -> None:
        """The target of a pull notifies each source, which frees the parked hand-over."""
        handles = [s.handle for s in sreq.mm_sources] + ([sreq.kv_source.handle] if sreq.kv_source else [])
        for handle in handles:
            self.workers[handle["agent"]].parked.discard(handle["request_id"])

    def aborts(self) -> set[tuple[str, str]]:
        """Every (worker name, request id) abort received."""
        return {(w.name, i) for w in self.workers.values() for i in w.aborts}

    def parked(self) -> set[tuple[str, str]]:
        return {(w.name, i) for w in self.workers.values() for i in w.parked}

    async def __aenter__(self) -> FakeCluster:
        sockets = []
        for _ in self.workers:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        sockets.sort(key=lambda s: _url(s))
        for worker, sock in zip(sorted(self.workers.values(), key=lambda w: w.name), sockets, strict=True):
            worker.url = _url(sock)
            config = uvicorn.Config(worker.app, log_config=None, log_level="critical", lifespan="off",
                                    timeout_graceful_shutdown=1)
            server = _Server(config)
            self._servers.append((server, asyncio.create_task(server.serve(sockets=[sock]))))
        for server, task in self._servers:
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        self.registry.set_urls([w.url for w in self.workers.values()])
        await self.registry.refresh(self.client)
        assert all(i.ready for i in self.registry.instances.values()), self.registry.instances
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closing.set()
        for worker in self.workers.values():
            if worker.channels is not None:
                worker.channels.close_all()
        await self.client.aclose()
        for server, _ in self._servers:
            server.should_exit = True
        for _, task in self._servers:
            await asyncio.wait_for(task, timeout=10)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # several servers share the test's process: its signal handlers stay as they are


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()
    return f"http://{host}:{port}"
