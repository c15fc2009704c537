"""Token ids -> text as it streams: stop strings on top of incremental detokenization,
SSE framing, and the pump that relays a backend's events.

Detokenization itself is the processor's (`MultimodalProcessor.detokenizer`): a
multi-byte character split across tokens is held back until complete, so the client
never sees a broken UTF-8 fragment.

Stop strings: the backend is asked to stop on them too, but the router is what trims
them from the text, and it holds back any tail that could still grow into a stop string.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Detokenizer(Protocol):
    """Incremental detokenization (the processor's `IncrementalDetokenizer`): `add` returns
    the newly completed text, holding back a character split across tokens; `flush` the
    rest at the end."""

    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class OutputText:
    """The text of one completion: detokenized, cut at the first stop string.

    `add` and `finish` return what may be sent to the client now; after a stop string is
    seen `stopped` is True and the caller ends the request (finish_reason 'stop')."""

    def __init__(self, detokenizer: Detokenizer, stop: Sequence[str] = ()) -> None:
        self._detok = detokenizer
        self.num_tokens = 0
        self._stops = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._sent = 0
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        if token_ids:
            self._append(self._detok.add(list(token_ids)))
        return self._take(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self._append(self._detok.flush())
        return self._take(final=True)

    def _append(self, piece: str) -> None:
        if not piece:
            return
        # A stop string can straddle the old end: search from where it could start.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        cut = self._find_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _take(self, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        end = max(end, self._sent)
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _held_back(self) -> int:
        """Length of the longest tail that is a proper prefix of some stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


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
        self._task = asyncio.create_task(self._run(events))
        self._done = False
        self._head: Any = self._EMPTY

    async def _run(self, events: AsyncIterator[Any]) -> None:
        try:
            async for event in events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(self._END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which reports it to the client
            self._queue.put_nowait(exc)
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def prime(self) -> None:
        """Wait for the first item without consuming it (raises the backend's exception)."""
        if self._head is self._EMPTY:
            self._head = await self._queue.get()
            if isinstance(self._head, BaseException):
                self._done = True
                raise self._head

    async def next(self) -> Any | None:
        """The next event; None at the end; re-raises the backend's exception."""
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

    async def close(self) -> None:
        """Cancel the backend if it is still running (= abort the request) and wait for
        its cleanup, at most abort_timeout_s; safe to call twice and from a cancelled scope."""
        self._done = True
        if self._task.done():
            return
        self._task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({self._task}, timeout=self._abort_timeout_s)
