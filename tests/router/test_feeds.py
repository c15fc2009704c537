"""router/feeds.py: the cut-overs due at one instance go in one `POST /internal/feed`."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from triptych.router.feeds import FeedBatcher
from triptych.stage_protocol import MAX_FEEDS, FeedBatch, FeedRequest

A, B = "http://a:1", "http://b:2"


def _lead(rid: str, start: int = 5) -> FeedRequest:
    return FeedRequest(request_id=rid, start=start, token_ids=[7, 8], lead=True)


class Worker:
    """A transport answering `/internal/feed` as a worker does: taken where it runs the id."""

    def __init__(self, runs: set[str], status: int = 200, short: bool = False) -> None:
        self.runs, self.status, self.short = runs, status, short
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/internal/feed"
        feeds = FeedBatch.model_validate_json(request.content).feeds
        self.calls.append((f"{request.url.scheme}://{request.url.host}:{request.url.port}",
                           [f.request_id for f in feeds]))
        taken = [f.request_id in self.runs for f in feeds]
        return httpx.Response(self.status, json={"taken": taken[:-1] if self.short else taken})


def _batcher(worker: Worker, window_s: float = 0.01) -> FeedBatcher:
    return FeedBatcher(httpx.AsyncClient(transport=httpx.MockTransport(worker)), window_s=window_s)


async def test_feeds_due_together_go_in_one_call_per_instance_and_each_gets_its_answer():
    worker = Worker(runs={"r1", "r3", "r4"})
    feeds = _batcher(worker)
    got = await asyncio.gather(feeds.send(A, _lead("r1")), feeds.send(A, _lead("r2")), feeds.send(B, _lead("r4")),
                               feeds.send(A, _lead("r3")))
    assert got == [True, False, True, True]
    assert sorted(worker.calls) == [(A, ["r1", "r2", "r3"]), (B, ["r4"])]
    # A feed after the window is a call of its own.
    assert await feeds.send(A, _lead("r1", start=7)) and worker.calls[-1] == (A, ["r1"])


@pytest.mark.parametrize("worker", [Worker(runs={"r1"}, status=503), Worker(runs={"r1"}, short=True)],
                         ids=["refused", "answer-of-another-length"])
async def test_a_call_that_does_not_answer_for_each_feed_takes_none(worker: Worker):
    feeds = _batcher(worker)
    assert await asyncio.gather(feeds.send(A, _lead("r1")), feeds.send(A, _lead("r2"))) == [False, False]


async def test_an_instance_that_cannot_be_reached_takes_none():
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    feeds = FeedBatcher(httpx.AsyncClient(transport=httpx.MockTransport(down)), window_s=0)
    assert await feeds.send(A, _lead("r1")) is False


async def test_a_caller_that_goes_leaves_the_others_their_answers():
    worker = Worker(runs={"r1", "r2"})
    feeds = _batcher(worker)
    gone = asyncio.create_task(feeds.send(A, _lead("r1")))
    stays = asyncio.create_task(feeds.send(A, _lead("r2")))
    await asyncio.sleep(0)
    gone.cancel()
    assert await stays is True and worker.calls == [(A, ["r1", "r2"])]
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_more_feeds_than_a_call_takes_go_in_several():
    worker = Worker(runs={f"r{i}" for i in range(MAX_FEEDS + 5)})
    feeds = _batcher(worker)
    got = await asyncio.gather(*(feeds.send(A, _lead(f"r{i}")) for i in range(MAX_FEEDS + 5)))
    assert all(got) and [len(ids) for _, ids in worker.calls] == [MAX_FEEDS, 5]


async def test_a_flush_cancelled_mid_call_answers_every_waiting_feed_false():
    started = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        started.set()
        await asyncio.sleep(10)
        return httpx.Response(200, json={"taken": [True]})

    feeds = FeedBatcher(httpx.AsyncClient(transport=httpx.MockTransport(slow)), window_s=0)
    waiting = asyncio.create_task(feeds.send(A, _lead("r1")))
    await asyncio.wait_for(started.wait(), 5)
    for task in list(feeds._tasks):
        task.cancel()
    assert await asyncio.wait_for(waiting, 5) is False


def test_the_feed_body_is_the_wire_contract():
    body = json.loads(FeedBatch(feeds=[_lead("r1")]).model_dump_json())
    assert body == {"feeds": [{"request_id": "r1", "start": 5, "token_ids": [7, 8], "lead": True}]}
    with pytest.raises(ValueError):
        FeedBatch(feeds=[])
