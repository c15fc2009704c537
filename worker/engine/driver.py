"""The driver: runs an engine's steps on a background thread, and bridges its outputs to
asyncio streams (`Engine.start` / `Engine.generate`).

The thread sleeps on a `threading.Event` until work arrives: every call that can give the
loop something to do (`add_request`, `abort`, `release`, `commit_mm`, `free_kv`,
`release_mm`, `stop`) sets it, so an idle instance costs no CPU and the first step after
idle starts at once. A stream waits on an asyncio queue that the thread fills with
`call_soon_threadsafe`: no side polls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from triptych.worker.engine.request import Request, RequestOutput, RequestValidationError

if TYPE_CHECKING:
    from triptych.worker.engine.engine import Engine

log = logging.getLogger(__name__)

# An idle wait is ended by `wake`; the timeout is a safety net only (one wake-up a minute).
IDLE_WAIT_S = 60.0
# Work that cannot progress (all of it waits on pulled data or on blocks someone else
# holds) is retried when woken, and at least this often in case a change went unsignalled.
STALLED_WAIT_S = 0.05


class EngineDriver:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._wakeup = threading.Event()
        self._sinks: dict[str, Callable[[RequestOutput], object]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def wake(self) -> None:
        self._wakeup.set()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="triptych-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)
        self._thread = None

    def _loop(self) -> None:
        engine = self._engine
        while not self._stopping:
            # Cleared before looking for work: a wake-up that lands after the check is kept.
            self._wakeup.clear()
            if not engine.has_work:
                self._wakeup.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug outside the model calls: fail everything, keep serving
                log.exception("engine step failed")
                outputs = engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
            if engine.stalled and not outputs:
                self._wakeup.wait(STALLED_WAIT_S)

    async def generate(self, req: Request, timeout_s: float | None) -> AsyncIterator[RequestOutput]:
        """See `Engine.generate`."""
        if self._thread is None:
            self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        if self._sinks.setdefault(req.request_id, sink) is not sink:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        done = added = False
        try:
            self._engine.add_request(req)
            added = True
            deadline = None if timeout_s is None else loop.time() + timeout_s
            while not done:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                out = await asyncio.wait_for(queue.get(), remaining)
                done = out.finished
                yield out
        finally:
            self._sinks.pop(req.request_id, None)
            if added and not done:
                self._engine.abort(req.request_id)
