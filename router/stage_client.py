"""The router's side of the stage protocol (triptych/stage_protocol.py): one call runs one
hop on one instance and yields its parsed events; aborts fan out to instances.

Failures are sorted here. Bad input a worker refuses (a 4xx other than 408/429, or an
`error` event with a 4xx status) is the client's: BackendError with that status, never
retried. Anything else — a 5xx, a dropped connection, silence longer than the read
timeout, a line that is no stage event — is the instance's: StageFailure, which the
orchestrator may retry elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

import httpx
from pydantic import ValidationError

from triptych.router.backend import BackendError
from triptych.router.feeds import FeedBatcher
from triptych.router.overhead import WaitClock
from triptych.router.registry import Instance
from triptych.router.routing_metrics import RoutingMetrics
from triptych.router.stage_channel import Channel, ChannelPool
from triptych.stage_protocol import (
    CHANNEL_GONE,
    CHANNEL_HEADER,
    CHANNEL_PATH,
    ROUTER_KEEPALIVE_EXPIRY_S,
    STAGE_FRAME_TYPE,
    EncodedEvent,
    ErrorEvent,
    FinishedEvent,
    MigratingEvent,
    PrefilledEvent,
    StageEvent,
    StageRequest,
    encode_stage_request,
    parse_stage_event,
)
from triptych.topology import Stage

log = logging.getLogger("triptych.router.stage_client")


def worker_client(internal_token: str | None) -> httpx.AsyncClient:
    """The client for every call to workers: it sends the internal token (worker/auth.py)
    on each one (stage runs, aborts; the /health probes too, which ignore it)."""
    if internal_token is None:
        log.warning("no internal token (TRIPTYCH_INTERNAL_TOKEN / --internal-token-file): workers "
                    "started without --insecure-no-auth will refuse every stage call")
    headers = {"authorization": f"Bearer {internal_token}"} if internal_token else {}
    return httpx.AsyncClient(headers=headers,
                             limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                                 keepalive_expiry=ROUTER_KEEPALIVE_EXPIRY_S))


class StageFailure(Exception):
    """A hop failed on its instance; another instance may succeed if nothing reached the client yet."""

    def __init__(self, instance: Instance, message: str, status: int = 502, stage: Stage | None = None) -> None:
        super().__init__(message)
        self.instance = instance
        self.status = status
        self.stage = stage


class StageClient:
    def __init__(self, client: httpx.AsyncClient, metrics: RoutingMetrics, channels: bool = True) -> None:
        self.client = client
        self.metrics = metrics
        self.channels = ChannelPool(client, enabled=channels)  # stage_channel.py
        self.feeds = FeedBatcher(client)  # feeds.py: live takeovers' cut-overs
        self._tasks: set[asyncio.Task[None]] = set()  # background work (aborts, drains), held until done

    async def run(self, inst: Instance, sreq: StageRequest, read_timeout_s: float,
                  waits: WaitClock | None = None, *, path: str = "/internal/run",
                  content: AsyncIterator[bytes] | None = None) -> AsyncIterator[StageEvent]:
        """POST /internal/run and yield its events (never an `error` one: those raise).
        `read_timeout_s` bounds each silence on the stream. `waits` counts the time spent
        waiting on the worker (not the time the caller spends between events). A takeover
        (router/takeover.py) posts to `path` a body streamed from `content` instead.
        A run goes on the instance's event channel where it has one (stage_channel.py)."""
        timeout = httpx.Timeout(connect=5.0, read=read_timeout_s, write=30.0, pool=5.0)
        channel = await self.channels.get(inst.url) if content is None else None
        tag = channel.subscribe() if channel is not None else None
        inst.inflight += 1
        label = "".join(s.value[0].upper() for s in sreq.stages)
        outcome = "error"
        # A stage request goes as the stage frame (raw bytes for its images); a takeover's
        # body is the NDJSON lines router/takeover.py streams.
        body: bytes | AsyncIterator[bytes] = encode_stage_request(sreq) if content is None else content
        content_type = STAGE_FRAME_TYPE if content is None else "application/x-ndjson"
        waits = waits or WaitClock()
        waiting = False
        first = True
        trace = _HopTrace(self.metrics)
        started = time.monotonic()
        resp: httpx.Response | None = None
        handed_off = False  # the rest of the answer is read (and the response closed) in the background
        attached = False  # the run is streaming on the channel: stopping early cancels it there
        ending = False  # its end is awaited on the channel in the background (`_end_on_channel`)
        headers = {"content-type": content_type}
        if channel is not None:
            headers[CHANNEL_HEADER] = f"{channel.cid} {tag}"
        try:
            waits.begin()
            waiting = True
            def request() -> httpx.Request:
                return self.client.build_request("POST", f"{inst.url}{path}", content=body, headers=headers,
                                                 timeout=timeout, extensions={"trace": trace})

            resp = await self.client.send(request(), stream=channel is None)
            if channel is not None and tag is not None and _channel_gone(resp):
                # The worker dropped that channel just now (nothing ran): this run streams on
                # its own, and the next one opens a new channel.
                self.channels.forget(channel)
                channel.unsubscribe(tag)
                channel = tag = None
                del headers[CHANNEL_HEADER]
                resp = await self.client.send(request(), stream=True)
            self.metrics.hop_phase("headers", time.monotonic() - started)
            if resp.status_code >= 400:
                text = (await resp.aread()).decode(errors="replace")
                if resp.status_code in (401, 403):  # our token, not the client's request
                    raise StageFailure(inst, f"{inst.url} refused the router's internal token "
                                             f"({resp.status_code})", status=502)
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise BackendError(resp.status_code, _error_message(text), code=_error_code(text))
                raise StageFailure(inst, f"{inst.url} answered {resp.status_code}: {text[:200]}",
                                   status=503 if resp.status_code in (429, 503) else 502)
            if channel is not None and tag is not None:
                attached = True
                lines = channel.lines(tag, read_timeout_s)
            else:
                lines = resp.aiter_lines()
            try:
                async for line in lines:
                    if line.strip():
                        waits.end()
                        waiting = False
                        if first:
                            self.metrics.hop_phase("first_event", time.monotonic() - started)
                            first = False
                        event = _checked(inst, line)
                        # The caller may stop reading at a terminal event: the hop succeeded.
                        outcome = "ok" if _terminal(event) else outcome
                        yield event
                        waits.begin()
                        waiting = True
            except GeneratorExit:
                if outcome == "ok" and channel is not None and tag is not None:  # attached: read it there
                    # As below, on the channel: a run still going a moment after its terminal
                    # event (a decode handed over live, whose reader cut over) is stopped.
                    self._background(self._end_on_channel(channel, tag, lines))
                    ending = True
                elif outcome == "ok":
                    # Read the end of the answer (the worker ends it right after the terminal
                    # event) so that the connection goes back to the pool — in the background:
                    # the request's next hop need not wait for the chunked stream's last bytes;
                    # one still going then is dropped, which stops it.
                    self._background(_drain_and_close(resp, lines))
                    handed_off = True
                raise
            outcome = "ok"
        except StageFailure as failure:
            outcome = "error"
            failure.stage = failure.stage or sreq.stages[0]
            raise
        except httpx.TimeoutException as exc:
            outcome = "error"
            raise StageFailure(inst, f"{inst.url} timed out after {time.monotonic() - started:.1f}s",
                               status=504, stage=sreq.stages[0]) from exc
        except httpx.ConnectError as exc:
            # Nothing reached the instance (it is gone, e.g. exited after a drain): as safe to
            # take elsewhere as a 503 refusal, the same hand-over included.
            outcome = "error"
            raise StageFailure(inst, f"{inst.url} unreachable: {exc}", status=503, stage=sreq.stages[0]) from exc
        except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
            outcome = "error"
            raise StageFailure(inst, f"{inst.url} failed: {type(exc).__name__}: {exc}",
                               stage=sreq.stages[0]) from exc
        finally:
            if resp is not None and not handed_off:
                await resp.aclose()
            if channel is not None and tag is not None and not ending:
                channel.unsubscribe(tag)
                if attached and outcome != "ok":  # as a dropped stream would: the worker stops the run
                    self._background(self._cancel(channel, tag))
            if waiting:
                waits.end()
            inst.inflight -= 1
            self.metrics.hop(label, outcome, time.monotonic() - started)

    async def _end_on_channel(self, channel: Channel, tag: str, lines: AsyncIterator[str],
                              timeout_s: float = 1.0) -> None:
        """Wait (bounded) for the end of a run whose reader stopped at its terminal event;
        cancel it on the worker if it does not end (what `_drain_and_close` does to a stream)."""
        try:
            async with asyncio.timeout(timeout_s):
                async for _ in lines:
                    pass
            ended = True
        except (TimeoutError, httpx.HTTPError):
            ended = False
        finally:
            channel.unsubscribe(tag)
        if not ended:
            await self._cancel(channel, tag)

    async def _cancel(self, channel: Channel, tag: str, timeout_s: float = 5.0) -> None:
        try:
            await self.client.post(f"{channel.url}{CHANNEL_PATH}/{channel.cid}/cancel/{tag}", timeout=timeout_s)
        except httpx.HTTPError as exc:
            log.debug("cancel of run %s on channel %s failed: %s", tag, channel.cid, exc)

    async def aclose(self) -> None:
        await self.channels.aclose()

    def abort_later(self, urls: Iterable[str], request_ids: Iterable[str], timeout_s: float) -> None:
        """`abort` in the background (a caller that goes on need not wait for a dead instance)."""
        self._background(self.abort(list(urls), list(request_ids), timeout_s))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` as a task held until done (the loop keeps only weak references)."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort(self, urls: Iterable[str], request_ids: Iterable[str], timeout_s: float) -> None:
        """Best effort, concurrently: POST /internal/abort/{id} for every (instance, id) pair.
        Shielded, so a caller being cancelled still lets the aborts go out."""
        async def one(url: str, request_id: str) -> None:
            try:
                await self.client.post(f"{url}/internal/abort/{request_id}", timeout=timeout_s)
            except httpx.HTTPError as exc:
                log.debug("abort of %s on %s failed: %s", request_id, url, exc)

        ids = list(request_ids)
        await asyncio.shield(asyncio.gather(*(one(u, i) for u in urls for i in ids)))


class _HopTrace:
    """httpx's trace hook for one hop: times a new connection's set-up and counts it (a
    reused persistent connection sends no connect events)."""

    def __init__(self, metrics: RoutingMetrics) -> None:
        self.metrics = metrics
        self.connect_started = 0.0

    async def __call__(self, name: str, info: dict[str, object]) -> None:
        if name == "connection.connect_tcp.started":
            self.connect_started = time.monotonic()
        elif name == "connection.connect_tcp.complete":
            self.metrics.connections_opened.inc()
            self.metrics.hop_phase("connect", time.monotonic() - self.connect_started)


async def _drain_and_close(resp: httpx.Response, lines: AsyncIterator[str], timeout_s: float = 1.0) -> None:
    """Read what is left of a finished hop's answer (the worker ends it right after its
    terminal event), so that httpx keeps the connection instead of closing it; bounded.
    Then close the response (a connection not read to its end is dropped, not reused)."""
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in lines:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass
    finally:
        await resp.aclose()


def _checked(inst: Instance, line: str) -> StageEvent:
    try:
        event = parse_stage_event(line)
    except ValidationError as exc:  # a worker that breaks the protocol has failed
        raise StageFailure(inst, f"{inst.url} sent a line that is no stage event: {line[:200]!r}") from exc
    if isinstance(event, ErrorEvent):
        if 400 <= event.status < 500:
            raise BackendError(event.status, event.message)
        raise StageFailure(inst, f"{inst.url}: {event.message}", status=event.status)
    return event


def _terminal(event: StageEvent) -> bool:
    """The event that ends a successful hop: a hand-over (a decode migrating on included),
    or the finish of a generation."""
    if isinstance(event, FinishedEvent):
        return event.finish_reason != "abort"
    return isinstance(event, EncodedEvent | PrefilledEvent | MigratingEvent)


def _channel_gone(resp: httpx.Response) -> bool:
    """A run refused because its event channel is no longer open on the worker."""
    return resp.status_code == 503 and _error_code(resp.text) == CHANNEL_GONE


def _error_code(body: str) -> str | None:
    """A worker error body's string `code` (e.g. invalid_image), if it names one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _error_message(body: str) -> str:
    """The message of an OpenAI-style (or plain) JSON error body, else the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict):
        return body
    error = data.get("error")
    return (error.get("message") if isinstance(error, dict) else None) or data.get("message") or body
