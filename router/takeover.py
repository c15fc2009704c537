"""Live migration of a decode about to move (a role switch or a drain on its instance;
EPDServe §3.2.4 migrate, done as Clark et al., "Live Migration of Virtual Machines",
NSDI '05 §3: pre-copy while it runs, then stop-and-copy of what is left).

The decode's instance sends a `precopy` event (a handle on the KV blocks already full) and
keeps decoding. The router at once picks the instance the decode will go on at and opens
the decode's next hop there, `POST /internal/takeover` (worker/takeover.py), with a body it
streams in two NDJSON lines: the hop's `StageRequest` now (its kv_source the full blocks:
the instance pulls them while the source goes on), and the hand-over of the `migrating`
event once the source stops the decode. The stop-and-copy then costs one line on an open
connection and a pull of the last, partial block(s) — not a new hop and all of the KV.

A source that hands the decode over live (`MigratingEvent.live`: make-before-break) keeps
decoding while the target pulls; `lead` cuts over (router/overlap.py): it sends the target
the tokens the source streamed since the hand-over (`POST /internal/feed`, with the other
cut-overs due at that instance: router/feeds.py), from which the target samples on.

A takeover that is never handed over (the decode finished at its source, the client went
away, or the chosen instance no longer takes decodes) is closed: its connection drops and
the instance lets go (pre-copied blocks sit evictable in its prefix cache; nothing leaks).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from triptych.router.overhead import WaitClock
from triptych.router.registry import Instance
from triptych.router.stage_client import StageClient, StageFailure
from triptych.stage_protocol import FeedRequest, HandOver, KVSource, StageEvent, StageRequest

END = object()  # what `events` ends at (also for `unread`)


class Takeover:
    """One moving decode's next hop, opened at `target` at its pre-copy and run as a task;
    `hand_over` sends the hand-over, `events` yields the hop's events as `StageClient.run`
    would (its failures raised there)."""

    def __init__(self, stages: StageClient, target: Instance, sreq: StageRequest, read_timeout_s: float,
                 waits: WaitClock) -> None:
        self.target, self.request_id = target, sreq.request_id
        self._tail: asyncio.Future[HandOver] = asyncio.get_running_loop().create_future()
        self._tail_sent = False
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._queue_front: deque[object] = deque()  # put back by `unread`
        self._feeds = stages.feeds
        first = sreq.model_dump_json().encode() + b"\n"
        self._task = asyncio.create_task(self._run(stages, sreq, read_timeout_s, waits, first))

    def hand_over(self, kv: KVSource, live: bool = False) -> None:
        """Send the decode's hand-over on the open connection: the source stopped the
        decode, or (`live`) goes on with it until `lead` (router/overlap.py)."""
        if not self._tail.done():
            self._tail.set_result(HandOver(**kv.model_dump(), live=live))

    def unread(self, item: object) -> None:
        """Put back what a reader of `events` took but did not use (an event, or the
        failure or end it met): the next reader gets it first."""
        self._queue_front.append(item)

    async def events(self) -> AsyncIterator[StageEvent]:
        while True:
            item = self._queue_front.popleft() if self._queue_front else await self._queue.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]

    async def lead(self, start: int, token_ids: list[int]) -> bool:
        """The cut-over of a live hand-over (router/overlap.py): the tokens the source
        streamed since the hand-over (output indices from `start`), after which the target
        samples. False when the target did not take it (it cannot lead: the source must
        finish the decode)."""
        feed = FeedRequest(request_id=self.request_id, start=start, token_ids=token_ids, lead=True)
        return await self._feeds.send(self.target.url, feed)  # with the other cut-overs there (feeds.py)

    def close(self) -> None:
        """Drop the hop (unused, or its reader gone): the instance sees the connection end."""
        self._task.cancel()
        if not self._tail.done():
            self._tail.cancel()

    async def _body(self, first: bytes) -> AsyncIterator[bytes]:
        yield first
        hand_over = await self._tail
        yield hand_over.model_dump_json().encode() + b"\n"
        self._tail_sent = True

    async def _run(self, stages: StageClient, sreq: StageRequest, read_timeout_s: float, waits: WaitClock,
                   first: bytes) -> None:
        try:
            async for event in stages.run(self.target, sreq, read_timeout_s, waits, path="/internal/takeover",
                                          content=self._body(first)):
                self._queue.put_nowait(event)
            self._queue.put_nowait(END)
        except asyncio.CancelledError:
            raise
        except StageFailure as failure:
            if not self._tail_sent:  # the instance never had the hand-over: as safe to retry as a 503
                failure.status = 503
            self._queue.put_nowait(failure)
        except BaseException as exc:  # a client error (BackendError) goes to the reader as it is
            self._queue.put_nowait(exc)
