"""The worker's side of the event channels (triptych/stage_protocol.py): a router holds one
open per instance, and each run it posts with CHANNEL_HEADER streams its events there
instead of in its own response.

Every run's chunk goes into the channel's buffer, and the channel's response writes what
the buffer holds once per event-loop turn: the streams an engine step wakes together
(worker/engine/driver.py hands a step's outputs over in one call) leave in one write.
A run's plain token lines skip its pump: the step's callback writes them (`writer`).
A run's end is an empty line of its tag. A channel that closes (the router went away, or
this instance finished draining) cancels its runs, as a dropped per-run stream does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from triptych.stage_protocol import CHANNEL_KEEPALIVE_S, ErrorEvent, channel_lines, encode_stage_event

log = logging.getLogger("triptych.worker.stage_channel")


class Channel:
    def __init__(self, cid: str, keepalive_s: float = CHANNEL_KEEPALIVE_S,
                 forget: Callable[[Channel], None] | None = None) -> None:
        self.cid = cid
        self._forget = forget
        self.keepalive_s = keepalive_s
        self.closed = False
        self._buffer: list[bytes] = []
        self._ready = asyncio.Event()
        self._runs: dict[str, asyncio.Task[None]] = {}

    @property
    def runs(self) -> int:
        return len(self._runs)

    def attach(self, tag: str, events: AsyncIterator[bytes]) -> None:
        """Stream a run's events (NDJSON chunks) on this channel under `tag`."""
        self._runs[tag] = asyncio.create_task(self._pump(tag, events))

    def writer(self, tag: str) -> Callable[[bytes], None]:
        """Writes a run's NDJSON chunk under `tag` from outside its pump (the engine's
        per-step callback, worker/stage_run.py), in order with what the pump writes."""
        key = tag.encode()
        return lambda chunk: self._put(channel_lines(key, chunk))

    def cancel(self, tag: str) -> bool:
        """Stop a run (the router stopped reading it): its stream's cleanup aborts it."""
        task = self._runs.get(tag)
        if task is not None:
            task.cancel()
        return task is not None

    def close(self) -> None:
        """End the channel's response; its runs are cancelled."""
        self.closed = True
        self._ready.set()

    def _put(self, lines: list[bytes]) -> None:
        if not self.closed:
            self._buffer.extend(lines)
            self._ready.set()

    async def _pump(self, tag: str, events: AsyncIterator[bytes]) -> None:
        key = tag.encode()
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for chunk in events:
                    self._put(channel_lines(key, chunk))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a run that fails outside its own error events fails its hop
            log.exception("run %s on channel %s failed", tag, self.cid)
            self._put(channel_lines(key, encode_stage_event(ErrorEvent(status=500, message=f"run failed: {exc}"))))
        finally:
            self._runs.pop(tag, None)
            self._put(channel_lines(key, b""))

    async def body(self) -> AsyncIterator[bytes]:
        """The channel's response: everything buffered since the last write, in one write."""
        try:
            while not self.closed:
                try:
                    async with asyncio.timeout(self.keepalive_s):
                        await self._ready.wait()
                except TimeoutError:
                    yield b"\n"
                    continue
                self._ready.clear()
                if self._buffer:
                    data = b"".join(self._buffer)
                    self._buffer.clear()
                    yield data
            if self._buffer:  # closed with lines not yet written
                yield b"".join(self._buffer)
        finally:
            self.closed = True
            for task in list(self._runs.values()):
                task.cancel()
            if self._forget is not None:
                self._forget(self)


class Channels:
    """The channels open on this instance, by id."""

    def __init__(self) -> None:
        self._open: dict[str, Channel] = {}

    def open(self, cid: str) -> Channel | None:
        """A new channel; None when `cid` is in use."""
        if cid in self._open and not self._open[cid].closed:
            return None
        channel = self._open[cid] = Channel(cid, forget=self._forget)
        return channel

    def _forget(self, channel: Channel) -> None:
        if self._open.get(channel.cid) is channel:
            del self._open[channel.cid]

    def get(self, cid: str) -> Channel | None:
        channel = self._open.get(cid)
        return channel if channel is not None and not channel.closed else None

    def close_all(self) -> None:
        for channel in list(self._open.values()):
            channel.close()
