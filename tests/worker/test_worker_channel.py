"""The worker's event channel (worker/stage_channel.py) on its own: what its response
writes, and what happens to the runs on it when they fail, are cancelled or it closes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from triptych.stage_protocol import split_channel_line
from triptych.worker.stage_channel import Channel, Channels


class _Run:
    """A run's event stream that yields `chunks`, one when `step` is set, and records its end."""

    def __init__(self, chunks: list[bytes], fail: bool = False) -> None:
        self.chunks = chunks
        self.fail = fail
        self.step = asyncio.Event()
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        try:
            for chunk in self.chunks:
                await self.step.wait()
                self.step.clear()
                yield chunk
            if self.fail:
                raise RuntimeError("boom")
        finally:
            self.closed = True


def _lines(data: bytes) -> list[tuple[str, str] | None]:
    return [split_channel_line(line) for line in data.decode().split("\n")[:-1]]


async def test_runs_woken_together_leave_in_one_write_each_line_under_its_tag():
    channel = Channel("c")
    body = channel.body()
    a, b = _Run([b'{"x":1}\n{"x":2}\n', b'{"x":3}\n']), _Run([b'{"y":1}\n', b'{"y":2}\n'])
    channel.attach("a", a.events())
    channel.attach("b", b.events())
    await asyncio.sleep(0)
    a.step.set()
    b.step.set()  # one engine step's outputs reach both streams in the same turn
    data = await asyncio.wait_for(anext(body), 1)
    assert _lines(data) == [("a", '{"x":1}'), ("a", '{"x":2}'), ("b", '{"y":1}')]
    a.step.set()
    b.step.set()  # their last chunks: each run's end (an empty line under its tag) goes with them
    tail = await asyncio.wait_for(anext(body), 1)
    assert _lines(tail) == [("a", '{"x":3}'), ("a", ""), ("b", '{"y":2}'), ("b", "")]
    assert a.closed and b.closed and channel.runs == 0
    await body.aclose()


async def test_a_failing_run_sends_an_error_event_then_its_end():
    channel = Channel("c")
    body = channel.body()
    run = _Run([], fail=True)
    channel.attach("r", run.events())
    lines = _lines(await asyncio.wait_for(anext(body), 1))
    assert lines[0] is not None and lines[0][0] == "r" and '"type":"error"' in lines[0][1].replace(" ", "")
    assert '"status":500' in lines[0][1].replace(" ", "") and "boom" in lines[0][1]
    assert lines[-1] == ("r", "")
    await body.aclose()


async def test_cancel_stops_one_run_and_its_stream_cleans_up():
    channel = Channel("c")
    body = channel.body()
    stuck, other = _Run([b"{}\n"]), _Run([b"{}\n"])
    channel.attach("s", stuck.events())
    channel.attach("o", other.events())
    await asyncio.sleep(0)
    assert channel.cancel("s") and not channel.cancel("nope")
    data = await asyncio.wait_for(anext(body), 1)
    assert _lines(data) == [("s", "")] and stuck.closed and not other.closed
    await body.aclose()
    await asyncio.sleep(0)
    assert other.closed  # the channel's end cancels what still runs on it


async def test_close_ends_the_response_and_cancels_its_runs():
    channels = Channels()
    channel = channels.open("c")
    assert channel is not None and channels.open("c") is None  # an id in use is refused
    run = _Run([b"{}\n"])
    channel.attach("r", run.events())
    body = channel.body()
    await asyncio.sleep(0)
    channels.close_all()
    assert [d async for d in body] == []  # closed: nothing more is written
    await asyncio.sleep(0)
    assert run.closed and channels.get("c") is None and channels.open("c") is not None


async def test_a_silent_channel_writes_keepalives():
    channel = Channel("c", keepalive_s=0.05)
    body = channel.body()
    assert await asyncio.wait_for(anext(body), 1) == b"\n"
    assert split_channel_line("") is None  # what the router skips
    await body.aclose()


def test_a_run_for_a_channel_the_worker_does_not_hold_is_refused_before_it_runs() -> None:
    from fastapi.testclient import TestClient

    from triptych.stage_protocol import CHANNEL_GONE, CHANNEL_HEADER
    from triptych.worker.auth import WorkerAuth
    from triptych.worker.server import create_app
    from triptych.worker.settings import WorkerSettings

    app = create_app(WorkerSettings(model="unused", instance_id="w-chan"), WorkerAuth.open())
    with TestClient(app) as client:
        r = client.post("/internal/run", json={}, headers={CHANNEL_HEADER: "nope 0"})
        assert r.status_code == 503 and r.json()["error"]["code"] == CHANNEL_GONE
        assert client.post("/internal/channel/nope/cancel/0").status_code == 404
