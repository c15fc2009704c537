"""The engine driver: sleeps while idle (no polling), wakes at once when work arrives, and
waits for a wake-up, not a timer, when all its work is stalled."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest

from triptych.worker.engine import driver as driver_module
from triptych.worker.engine.driver import EngineDriver
from triptych.worker.engine.request import Request, RequestOutput, RequestValidationError


class FakeEngine:
    """What the driver uses of an Engine: has_work, step, stalled, add_request, abort, fail_all."""

    def __init__(self, cpus: tuple[int, ...] | None = None, stream_interval: int = 1) -> None:
        self.config = SimpleNamespace(cpus=cpus, stream_interval=stream_interval)
        self.step_cpus: set[int] | None = None  # the CPUs the step thread may run on
        self.inbox: deque[Request] = deque()
        self.blocked = False
        self.stalled = False
        self.checks = 0
        self.steps = 0
        self.aborted: list[str] = []
        self.warm_sizes: list[int] = []  # what `warm_ups` yields
        self.warm_pause_s = 0.0  # how long each size takes to build
        self.warmed: list[tuple[int, str]] = []  # (size, the thread it was built on)
        self.driver = EngineDriver(self)  # type: ignore[arg-type]

    def warm_ups(self):
        for size in self.warm_sizes:
            time.sleep(self.warm_pause_s)
            if size < 0:
                raise RuntimeError("no kernel for that")
            self.warmed.append((size, threading.current_thread().name))
            yield size

    @property
    def has_work(self) -> bool:
        self.checks += 1
        return bool(self.inbox)

    def add_request(self, req: Request) -> None:
        self.inbox.append(req)
        self.driver.wake()

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def unblock(self) -> None:  # e.g. commit_mm: the data a stalled request waited for is in
        self.blocked = False
        self.driver.wake()

    def step(self) -> list[RequestOutput]:
        self.step_cpus = os.sched_getaffinity(0)
        self.steps += 1
        self.stalled = self.blocked
        if self.blocked:
            return []
        outs = [RequestOutput(r.request_id, [1], finished=True) for r in self.inbox]
        self.inbox.clear()
        return outs

    def fail_all(self, why: str) -> list[RequestOutput]:
        return []


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch):
    # Timers far beyond the test: anything that happens in time was woken, not polled.
    monkeypatch.setattr(driver_module, "IDLE_WAIT_S", 3600.0)
    monkeypatch.setattr(driver_module, "STALLED_WAIT_S", 3600.0)
    e = FakeEngine()
    yield e
    e.driver.stop(timeout_s=5)


async def _run(e: FakeEngine, rid: str) -> list[RequestOutput]:
    return [out async for out in e.driver.generate(Request(rid, [1]), timeout_s=5)]


async def test_idle_driver_does_not_poll_and_wakes_on_work(engine: FakeEngine) -> None:
    engine.driver.start()
    await asyncio.sleep(0.3)
    assert engine.checks <= 1  # one look at start-up, then asleep
    t0 = time.monotonic()
    outs = await _run(engine, "a")
    assert outs[-1].finished and time.monotonic() - t0 < 1.0
    assert engine.steps == 1


async def test_an_idle_driver_builds_the_kernels_ahead_on_its_thread_then_sleeps(engine: FakeEngine) -> None:
    engine.warm_sizes = [1, 2, 4, 8]
    engine.driver.start()
    await asyncio.sleep(0.3)
    assert engine.warmed == [(1, "triptych-engine"), (2, "triptych-engine"), (4, "triptych-engine"),
                             (8, "triptych-engine")]
    assert engine.checks == 5  # a look for work before each size and one after: then asleep
    outs = await _run(engine, "a")
    assert outs[-1].finished and engine.steps == 1


async def test_work_that_comes_during_the_warm_up_goes_first(engine: FakeEngine) -> None:
    engine.warm_sizes, engine.warm_pause_s = list(range(1, 41)), 0.05  # two seconds of building
    engine.driver.start()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    outs = await _run(engine, "a")
    assert outs[-1].finished and time.monotonic() - t0 < 0.5  # served between two sizes
    assert len(engine.warmed) < 20
    await asyncio.sleep(2.5)
    assert [size for size, _ in engine.warmed] == list(range(1, 41))  # and the rest built after it


async def test_a_failing_warm_up_is_logged_and_the_driver_serves_on(engine: FakeEngine,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    engine.warm_sizes = [1, -1, 4]
    with caplog.at_level(logging.ERROR, logger="triptych.worker.engine.driver"):
        engine.driver.start()
        await asyncio.sleep(0.2)
    assert engine.warmed == [(1, "triptych-engine")]  # nothing after the failure
    assert "building GEMM kernels ahead failed" in caplog.text
    outs = await _run(engine, "a")
    assert outs[-1].finished


async def test_stalled_work_waits_for_a_wake_up(engine: FakeEngine) -> None:
    engine.blocked = True
    engine.driver.start()
    task = asyncio.create_task(_run(engine, "s"))
    await asyncio.sleep(0.3)
    assert engine.steps == 1 and not task.done()  # tried once, then slept: no spinning
    engine.unblock()
    outs = await asyncio.wait_for(task, 1.0)
    assert outs[-1].finished and engine.steps == 2


async def test_stop_ends_an_idle_driver_at_once(engine: FakeEngine) -> None:
    engine.driver.start()
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    engine.driver.stop(timeout_s=5)
    assert not engine.driver.running and time.monotonic() - t0 < 1.0


async def test_a_duplicate_stream_id_is_refused_and_a_left_stream_aborts(engine: FakeEngine) -> None:
    engine.blocked = True  # keeps the first stream open
    first = engine.driver.generate(Request("d", [1]), timeout_s=5)
    pending = asyncio.ensure_future(first.__anext__())
    await asyncio.sleep(0.1)
    with pytest.raises(RequestValidationError, match="already in use"):
        await _run(engine, "d")
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await first.aclose()
    assert engine.aborted == ["d"]


async def test_the_step_thread_runs_on_the_engines_cpus_and_the_loop_keeps_its_own() -> None:
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    e = FakeEngine(cpus=(cpu,))
    try:
        outs = await _run(e, "b")
        assert outs[-1].finished and e.step_cpus == {cpu}
        assert os.sched_getaffinity(0) == mine  # the caller's thread is not moved
    finally:
        e.driver.stop(timeout_s=5)


async def test_cpus_it_may_not_use_leave_the_step_thread_where_it_was(caplog: pytest.LogCaptureFixture) -> None:
    e = FakeEngine(cpus=(4095,))  # outside any cpuset here: sched_setaffinity refuses (EINVAL)
    try:
        with caplog.at_level(logging.WARNING, logger="triptych.worker.engine.driver"):
            outs = await _run(e, "w")
        assert outs[-1].finished and e.step_cpus == os.sched_getaffinity(0)
        assert "engine thread not bound to CPUs 4095" in caplog.text
    finally:
        e.driver.stop(timeout_s=5)


def _tok(rid: str, t: int, **kw: object) -> RequestOutput:
    return RequestOutput(rid, [t], **kw)  # type: ignore[arg-type]


async def _delivered(e: FakeEngine, queue: asyncio.Queue[RequestOutput], outs: list[RequestOutput]) -> list[int]:
    """Hand `outs` to the driver as one step's outputs; the tokens that reached the stream."""
    e.driver.deliver(outs)
    await asyncio.sleep(0.05)  # call_soon_threadsafe's callback runs on this loop
    got = []
    while not queue.empty():
        got += queue.get_nowait().new_token_ids
    return got


@asynccontextmanager
async def _stream(e: FakeEngine, req: Request, first: int) -> AsyncIterator[tuple[asyncio.Queue[RequestOutput], list[list[int]]]]:
    """`req`'s stream on `e`, blocked (its own steps produce nothing: the test hands the
    driver each step's outputs), once it got its first token `first`: the sink's queue and
    the token ids of that first batch. Closes the stream and stops the driver after."""
    e.blocked = True
    stream = e.driver.generate_batches(req, timeout_s=5)
    opened = asyncio.ensure_future(stream.__anext__())  # registers the sink
    await asyncio.sleep(0.05)
    try:
        e.driver.deliver([_tok(req.request_id, first)])
        batch = await asyncio.wait_for(opened, 1)
        yield e.driver._sinks[req.request_id].queue, [o.new_token_ids for o in batch]
    finally:
        await stream.aclose()
        e.driver.stop(timeout_s=5)


async def test_a_stream_interval_sends_the_first_token_at_once_then_n_at_a_time() -> None:
    e = FakeEngine(stream_interval=3)
    async with _stream(e, Request("r", [1]), 10) as (queue, first):
        assert first == [[10]]  # the first token: its TTFT is not held
        assert await _delivered(e, queue, [_tok("r", 11)]) == []
        assert await _delivered(e, queue, [_tok("r", 12)]) == []
        assert await _delivered(e, queue, [_tok("r", 13)]) == [11, 12, 13]
        assert await _delivered(e, queue, [_tok("r", 14)]) == []
        # Anything but a plain token output takes what is held with it, in order; a decode
        # on its way out (a pre-copy) then streams each token at once: the router cuts over
        # after a token it has.
        assert await _delivered(e, queue, [_tok("r", 15, precopy=True)]) == [14, 15]
        assert await _delivered(e, queue, [_tok("r", 16)]) == [16]
        assert await _delivered(e, queue, [_tok("r", 17)]) == [17]


async def test_a_requests_own_interval_overrides_the_engines_and_a_finish_flushes() -> None:
    e = FakeEngine(stream_interval=1)  # the engine streams each token; this request asked for fours
    async with _stream(e, Request("w", [1], stream_interval=4), 10) as (queue, first):
        assert first == [[10]]
        assert [await _delivered(e, queue, [_tok("w", t)]) for t in (11, 12, 13, 14)] == [[], [], [], [11, 12, 13, 14]]
        assert await _delivered(e, queue, [_tok("w", 15)]) == []
        assert await _delivered(e, queue, [_tok("w", 16, finished=True)]) == [15, 16]


async def test_without_an_interval_and_for_a_takeover_every_token_goes_at_once() -> None:
    for interval, feed in ((1, None), (4, object())):
        e = FakeEngine(stream_interval=interval)
        req = Request("t", [1])
        req.feed = feed  # type: ignore[assignment]  # a live takeover's target (token_feed.py)
        async with _stream(e, req, 1) as (queue, _):
            assert [await _delivered(e, queue, [_tok("t", i)]) for i in (2, 3, 4)] == [[2], [3], [4]]


async def test_held_tokens_go_out_once_the_oldest_waited_max_hold_s(monkeypatch: pytest.MonkeyPatch) -> None:
    # A slow decode under a large interval: its stream is not left silent for a whole group.
    monkeypatch.setattr(driver_module, "MAX_HOLD_S", 0.5)
    e = FakeEngine(stream_interval=16)
    async with _stream(e, Request("s", [1]), 10) as (queue, _):
        e.driver.deliver([_tok("s", 11)])
        assert await _delivered(e, queue, [_tok("s", 12)]) == []  # well within 0.5 s: held
        await asyncio.sleep(0.6)
        assert await _delivered(e, queue, [_tok("s", 13)]) == [11, 12, 13]
        assert await _delivered(e, queue, [_tok("s", 14)]) == []  # a new group starts


async def test_a_direct_take_gets_a_steps_outputs_while_the_queue_is_empty_and_keeps_order(
        caplog: pytest.LogCaptureFixture) -> None:
    # An event channel's run takes its plain tokens on the loop, without waking its task.
    e = FakeEngine()
    e.blocked = True
    taken: list[list[int]] = []
    fail = [False]

    def direct(outs: list[RequestOutput]) -> bool:
        if fail[0]:
            raise RuntimeError("boom")
        if any(o.finished for o in outs):
            return False
        taken.append([t for o in outs for t in o.new_token_ids])
        return True

    stream = e.driver.generate_batches(Request("d", [1]), timeout_s=5, direct=direct)
    opened = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.05)
    queue = e.driver._sinks["d"].queue
    try:
        queue.put_nowait(_tok("d", 0))
        assert [o.new_token_ids for o in await asyncio.wait_for(opened, 1)] == [[0]]
        queue.put_nowait(_tok("d", 1))  # not yet read by the stream: what follows queues behind it
        assert await _delivered(e, queue, [_tok("d", 2)]) == [1, 2] and taken == []
        assert await _delivered(e, queue, [_tok("d", 3), _tok("e", 9)]) == [] and taken == [[3]]
        assert await _delivered(e, queue, [_tok("d", 4, finished=True)]) == [4]  # refused: queued
        fail[0] = True
        with caplog.at_level(logging.ERROR, logger=driver_module.__name__):
            assert await _delivered(e, queue, [_tok("d", 5)]) == [5]  # it raised: the stream gets it
        fail[0] = False
        assert await _delivered(e, queue, [_tok("d", 6)]) == [6] and taken == [[3]]  # and no more takes
        assert "direct take failed" in caplog.text
    finally:
        opened.cancel()
        await stream.aclose()
        e.driver.stop(timeout_s=5)
