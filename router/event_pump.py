"""The backend's events on their way to one response: `EventPump` consumes them in a task
of its own (and cancels it = aborts the request), `coalesce` merges token events that
are already queued, so a response that fell behind catches up in one chunk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from triptych.router.backend import TokenEvent

# How long the backend may wait for the response to write its first event (`_first_written`).
FIRST_WRITE_WAIT_S = 0.05


class EventPump:
    """Consumes a backend's event iterator in a task of its own.

    Why a task: a client disconnect cancels the response's anyio scope, and anyio keeps
    re-cancelling every await inside that scope - a backend's abort calls in its
    `finally` would be cut short. Behind the pump the backend sees exactly one
    CancelledError (asyncio's edge-triggered kind) and `close` waits, shielded and
    bounded, for its cleanup to finish."""

    _END = object()
    _EMPTY = object()

    def __init__(self, events: AsyncIterator[Any], abort_timeout_s: float) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._abort_timeout_s = abort_timeout_s
        self._done = False
        self._head: Any = self._EMPTY
        self._handed = False  # `next` handed out an event
        self._asked_again = asyncio.Event()  # ... and was called again since
        self._holding = False  # the task waits for the first event's write (`_first_written`)
        self._task = asyncio.create_task(self._run(events))

    async def _run(self, events: AsyncIterator[Any]) -> None:
        try:
            first = True
            async for event in events:
                self._queue.put_nowait(event)
                if first:
                    first = False
                    await self._first_written()
            self._queue.put_nowait(self._END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which reports it to the client
            self._queue.put_nowait(exc)
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _first_written(self) -> None:
        """Let the response start and write the first event before the backend goes on
        (bounded: FIRST_WRITE_WAIT_S). After a prefill's hand-over the backend dispatches
        the decode hop next, a millisecond or two of work on this event loop; the response's
        start (its headers, then the first chunk) would otherwise wait behind it, and TTFT
        with it."""
        self._holding = True
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_WRITE_WAIT_S):
                    await self._asked_again.wait()
        finally:
            self._holding = False

    async def prime(self) -> None:
        """Wait for the first item without consuming it (raises the backend's exception)."""
        if self._head is self._EMPTY:
            self._head = await self._queue.get()
            if isinstance(self._head, BaseException):
                self._done = True
                raise self._head

    def take_ready(self) -> Any | None:
        """The next event if one is already queued (no wait), else None; the end of the
        stream and a failure stay queued for `next`."""
        if self._done:
            return None
        if self._head is self._EMPTY:
            if self._queue.empty():
                return None
            self._head = self._queue.get_nowait()
        if self._head is self._END or isinstance(self._head, BaseException):
            return None
        item, self._head = self._head, self._EMPTY
        return item

    def put_back(self, item: Any) -> None:
        """Undo `take_ready`: `item` is the next event again."""
        assert self._head is self._EMPTY
        self._head = item

    async def next(self) -> Any | None:
        """The next event; None at the end; re-raises the backend's exception."""
        if self._handed:  # the consumer is back for more: what it took was written
            self._asked_again.set()
        self._handed = True
        if self._done:
            return None
        if self._head is not self._EMPTY:
            item, self._head = self._head, self._EMPTY
        else:
            item = await self._queue.get()
        if item is self._END:
            self._done = True
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    async def close(self, grace_s: float = 0.0) -> None:
        """Cancel the backend if it is still running (= abort the request) and wait for
        its cleanup, at most abort_timeout_s; safe to call twice and from a cancelled scope.
        `grace_s`: after a response got every finish, the backend is only closing its
        stage streams; let it end on its own that long first (a cancel would send aborts
        for a finished request and drop the worker connection instead of reusing it)."""
        self._done = True
        if self._task.done():
            return
        if self._holding:
            # Held for the first write: back into the backend first, where a cancel reaches
            # it (its aborts run on CancelledError; at a yield it would only see GeneratorExit).
            self._asked_again.set()
            with anyio.CancelScope(shield=True):
                await asyncio.sleep(0)
        if grace_s > 0:
            with anyio.CancelScope(shield=True):
                await asyncio.wait({self._task}, timeout=grace_s)
            if self._task.done():
                return
        self._task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({self._task}, timeout=self._abort_timeout_s)


def coalesce(event: Any, pump: EventPump) -> Any:
    """`event` with the token events of the same choice already queued behind it: a
    response that fell behind catches up in one chunk (one detokenize call, one JSON
    encode, one write) instead of one per token. A finish ends the merge."""
    while event.finish_reason is None:
        more = pump.take_ready()
        if more is None:
            break
        if more.index != event.index or (more.logprobs is None) != (event.logprobs is None):
            pump.put_back(more)
            break
        event = TokenEvent(token_ids=[*event.token_ids, *more.token_ids], finish_reason=more.finish_reason,
                           index=event.index,
                           logprobs=None if event.logprobs is None else [*event.logprobs, *more.logprobs])
    return event
