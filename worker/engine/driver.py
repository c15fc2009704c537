"""The driver: runs an engine's steps on a background thread, and bridges its outputs to
asyncio streams (`Engine.start` / `Engine.generate`).

The thread sleeps on a `threading.Event` until work arrives: every call that can give the
loop something to do (`add_request`, `abort`, `release`, `commit_mm`, `free_kv`,
`release_mm`, `stop`) sets it, so an idle instance costs no CPU and the first step after
idle starts at once. A stream waits on an asyncio queue that the thread fills with
`call_soon_threadsafe`: no side polls. One such call per event loop per step hands over
every output of the step (not one per output: each call wakes the loop through its
self-pipe and costs the engine thread Python work it holds the GIL for), and a stream
takes everything queued for it at once (`generate_batches`): a stream that fell behind
catches up in one write. A stream may also take its plain token outputs on the loop,
in the step's one callback, without waking its task (`direct`: the event channel's runs,
worker/stage_run.py): with 32 streams that is one wake-up a step instead of 32. While
idle, the thread first builds the GEMM kernels of the batch sizes to come
(`Engine.warm_ups`, a size at a time between looks for work): oneDNN builds them per
thread, on first use otherwise (worker/models/linear_kernels.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from triptych.cpu_binding import bind_current_thread, format_cpu_list
from triptych.worker.engine.request import Request, RequestOutput, RequestValidationError

if TYPE_CHECKING:
    from triptych.worker.engine.engine import Engine

log = logging.getLogger(__name__)

# An idle wait is ended by `wake`; the timeout is a safety net only (one wake-up a minute).
IDLE_WAIT_S = 60.0
# Work that cannot progress (all of it waits on pulled data or on blocks someone else
# holds) is retried when woken, and at least this often in case a change went unsignalled.
STALLED_WAIT_S = 0.05
# A stream's held tokens go out with its next output once the oldest has waited this long,
# whatever the interval: a slow decode (a large batch on a capped CPU) never leaves the
# router's stream silent for a whole group of steps.
MAX_HOLD_S = 1.0


@dataclass(eq=False)
class _Sink:
    """Where one request's outputs go: a queue read on `loop`. `held`: token outputs kept
    back under a stream interval (`EngineConfig.stream_interval`), written on the engine
    thread only (under `EngineDriver._hold_lock`)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]
    interval: int = 1  # 1: every output at once (also once the decode is on its way out)
    delivered: bool = False  # a token output went out: the first one (TTFT) is never held
    held: list[RequestOutput] = field(default_factory=list)
    held_since: float = 0.0  # time.monotonic() when the oldest held output was held
    # Called on the loop with a step's outputs for this stream while its queue is empty;
    # True when it took them (the stream never sees them), False to queue them as usual.
    direct: Callable[[list[RequestOutput]], bool] | None = None


def _deliver(items: list[tuple[_Sink, list[RequestOutput]]]) -> None:
    """Runs on the event loop: one step's outputs into their streams' queues, or taken
    directly. Only while a queue is empty: a stream's outputs stay in order."""
    for sink, outs in items:
        if sink.direct is not None and sink.queue.empty():
            try:
                if sink.direct(outs):
                    continue
            except Exception:  # the stream sees them instead; its own handling decides
                log.exception("a stream's direct take failed")
                sink.direct = None
        for out in outs:
            sink.queue.put_nowait(out)


class EngineDriver:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._interval = engine.config.stream_interval
        self._hold_lock = threading.Lock()  # deliver runs on the engine thread or under the engine's lock
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
        if engine.config.cpus:
            try:
                bind_current_thread(engine.config.cpus)
            except OSError as exc:  # a CPU outside this process's cpuset: run where it may
                log.warning("engine thread not bound to CPUs %s: %s", format_cpu_list(engine.config.cpus), exc)
        warming: Iterator[int] | None = engine.warm_ups()  # GEMM kernels built ahead, while idle
        while not self._stopping:
            # Cleared before looking for work: a wake-up that lands after the check is kept.
            self._wakeup.clear()
            if not engine.has_work:
                if warming is not None and self._warm_one(warming):
                    continue  # one batch size's kernels built: look for work again
                warming = None
                self._wakeup.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug outside the model calls: fail everything, keep serving
                log.exception("engine step failed")
                outputs = engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            self.deliver(outputs)
            if engine.stalled and not outputs:
                self._wakeup.wait(STALLED_WAIT_S)

    @staticmethod
    def _warm_one(warming: Iterator[int]) -> bool:
        """Build the next size's kernels (worker/models/linear_kernels.py); False once
        there are none left, or building failed (they are then built on first use)."""
        try:
            return next(warming, None) is not None
        except Exception:  # a kernel that fails here fails its first step too, which reports it
            log.exception("building GEMM kernels ahead failed")
            return False

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their streams: one call_soon_threadsafe per event loop. Runs on the
        engine thread after each step, or under the engine's lock (`Engine.set_role`).
        Under a stream interval N > 1, a stream's plain token outputs after its first go out
        N at a time; anything else (finished, an error, a hand-off, a pre-copy) takes what
        is held with it, in order."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, list[RequestOutput]]]] = {}
        with self._hold_lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                due = self._due(sink, out) if sink.interval > 1 else [out]
                if due:
                    by_loop.setdefault(sink.loop, []).append((sink, due))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody reads these streams any more
                log.debug("dropped %d outputs for a closed event loop", len(items))

    def _due(self, sink: _Sink, out: RequestOutput) -> list[RequestOutput]:
        """What of `sink`'s outputs goes out now, `out` included or held (vLLM's and
        SGLang's `--stream-interval`: fewer, larger stream writes for the host to make)."""
        plain = out.new_token_ids and not (out.finished or out.error or out.handoff or out.precopy)
        if plain and sink.delivered and len(sink.held) + 1 < sink.interval:
            now = time.monotonic()
            if not sink.held:
                sink.held_since = now
            if now - sink.held_since < MAX_HOLD_S:
                sink.held.append(out)
                return []
        due = [*sink.held, out]
        sink.held.clear()
        sink.delivered = sink.delivered or bool(out.new_token_ids)
        if out.handoff or out.precopy:
            # A decode on its way to another instance streams every token from here on: the
            # router cuts over after a token it has (make-before-break), so none may wait here.
            sink.interval = 1
        return due

    async def generate(self, req: Request, timeout_s: float | None) -> AsyncIterator[RequestOutput]:
        """See `Engine.generate`."""
        async with aclosing(self.generate_batches(req, timeout_s)) as batches:
            async for batch in batches:
                for out in batch:
                    yield out

    async def generate_batches(self, req: Request, timeout_s: float | None,
                               direct: Callable[[list[RequestOutput]], bool] | None = None,
                               ) -> AsyncIterator[list[RequestOutput]]:
        """Like `generate`, but each item is every output queued for the request when the
        stream looked (at least one; the last one of the last list is `finished`). Outputs
        that `direct` takes (on the loop, see `_Sink.direct`) are not among them."""
        if self._thread is None:
            self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        # A takeover's target streams each token at once: its first one ends the hop.
        sink = _Sink(loop, queue, 1 if req.feed is not None else req.stream_interval or self._interval,
                     direct=direct)
        if self._sinks.setdefault(req.request_id, sink) is not sink:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        done = added = False
        try:
            self._engine.add_request(req)
            added = True
            deadline = None if timeout_s is None else loop.time() + timeout_s
            while not done:
                if queue.empty():
                    async with asyncio.timeout_at(deadline):
                        batch = [await queue.get()]
                else:
                    batch = []
                while not queue.empty() and not (batch and batch[-1].finished):
                    batch.append(queue.get_nowait())
                done = batch[-1].finished
                yield batch
        finally:
            self._sinks.pop(req.request_id, None)
            if added and not done:
                self._engine.abort(req.request_id)
