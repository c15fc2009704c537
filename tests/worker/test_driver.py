"""The engine driver: sleeps while idle (no polling), wakes at once when work arrives, and
waits for a wake-up, not a timer, when all its work is stalled."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest

from triptych.worker.engine import driver as driver_module
from triptych.worker.engine.driver import EngineDriver
from triptych.worker.engine.request import Request, RequestOutput, RequestValidationError


class FakeEngine:
    """What the driver uses of an Engine: has_work, step, stalled, add_request, abort, fail_all."""

    def __init__(self) -> None:
        self.inbox: deque[Request] = deque()
        self.blocked = False
        self.stalled = False
        self.checks = 0
        self.steps = 0
        self.aborted: list[str] = []
        self.driver = EngineDriver(self)  # type: ignore[arg-type]

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
