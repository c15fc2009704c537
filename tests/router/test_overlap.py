"""Make-before-break (router/overlap.py): a decode handed over live keeps streaming from
its source while its takeover pulls the KV and follows the fed tokens; once the target
is ready, the overlap cuts over right after a token from the source. The client gets
every output index once, in order; the target is fed every token the client got, then
the lead at the client's next index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from triptych.router.overlap import Overlap
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.stage_protocol import FinishedEvent, KVSource, MigratingEvent, StageEvent, TokensEvent
from triptych.topology import InstanceType

SOURCE = Instance(url="http://d0", role=InstanceType.D)
TARGET = Instance(url="http://d1", role=InstanceType.D)
# The hand-over: tokens 0..4 streamed (generated 0..3 and first_token 4): the next index is 5.
KV = KVSource(handle={}, num_tokens=12, first_token=104, generated=[100, 101, 102, 103])
READY = TokensEvent(token_ids=[], start=5)  # the target's first event: the decode is in its engine


class Stream:
    """Events put in by the test, read by the overlap; `None` ends the stream, an
    exception is raised to the reader."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    def put(self, *items: object) -> None:
        for item in items:
            self.queue.put_nowait(item)

    async def events(self) -> AsyncIterator[StageEvent]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]


class FakeTakeover(Stream):
    target, request_id = TARGET, "req.t1"

    def __init__(self, feed_fails: bool = False) -> None:
        super().__init__()
        self.fed: list[tuple[int, list[int]]] = []
        self.led: list[int] = []
        self.closed = False
        self.feed_failed = feed_fails

    def feed(self, start: int, token_ids: list[int]) -> None:
        self.fed.append((start, list(token_ids)))

    def lead(self, length: int) -> None:
        self.led.append(length)

    def close(self) -> None:
        self.closed = True


async def _drain(overlap: Overlap, source: Stream, steps) -> list[list[int]]:
    """Run the overlap; `steps` puts events on either stream as the test scripts them."""
    got: list[list[int]] = []

    async def consume() -> None:
        async for event in overlap.run(source.events()):
            got.append(event.token_ids)

    task = asyncio.create_task(consume())
    for step in steps:
        step()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(task, 5)
    return got


def tokens(ids: list[int], start: int | None = None) -> TokensEvent:
    return TokensEvent(token_ids=ids, start=start)


def overlap_of(target: FakeTakeover) -> Overlap:
    return Overlap(SOURCE, target, KV)  # type: ignore[arg-type]


async def test_the_source_streams_through_the_hop_and_the_cut_follows_its_first_token_after_the_target_is_ready():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106, 107])),
        lambda: target.put(READY),  # pulled and admitted: following
        lambda: source.put(tokens([108])),  # relayed, then the cut
    ])
    assert got == [[105], [106, 107], [108]]
    assert overlap.took_over and overlap.finished is None and overlap.next_index == 9
    assert target.fed == [(5, [105]), (6, [106, 107]), (8, [108])]  # every token the client got, by index
    assert target.led == [9] and not target.closed  # the target samples index 9 on


async def test_the_source_finishing_first_ends_the_request():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: source.put(FinishedEvent(finish_reason="length")),
    ])
    assert got == [[105]] and overlap.finished is not None and overlap.finished_by is SOURCE
    assert not overlap.took_over and target.led == []


async def test_the_target_finishing_on_fed_tokens_ends_the_request_without_repeating_them():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105, 106])),
        lambda: target.put(tokens([105, 106], start=5), FinishedEvent(finish_reason="length")),
    ])
    assert got == [[105, 106]] and overlap.finished_by is TARGET


async def test_a_source_that_fails_before_the_target_is_ready_is_cut_over_from_once_it_is():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105]), StageFailure(SOURCE, "connection reset")),
        lambda: target.put(READY),
    ])
    assert got == [[105]] and overlap.took_over and target.led == [6]


async def test_a_source_aborted_after_the_target_is_ready_is_cut_over_from_at_once():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(FinishedEvent(finish_reason="abort")),  # a switch's deadline stopped it
    ])
    assert got == [] and overlap.took_over and target.led == [5] and overlap.finished is None


async def test_a_target_that_fails_leaves_the_source_to_finish_the_decode():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(StageFailure(TARGET, "pull failed")),
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106]), FinishedEvent(finish_reason="stop")),
    ])
    assert got == [[105], [106]] and overlap.finished_by is SOURCE and target.led == []


async def test_a_target_moving_on_before_the_cut_is_let_go():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(MigratingEvent(kv=KV, live=True)),
        lambda: source.put(tokens([105]), FinishedEvent(finish_reason="stop")),
    ])
    assert target.closed and got == [[105]] and overlap.finished_by is SOURCE


async def test_a_target_that_missed_a_feed_is_never_cut_over_to():
    source, target = Stream(), FakeTakeover(feed_fails=True)
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106]), FinishedEvent(finish_reason="stop")),
    ])
    assert got == [[105], [106]] and overlap.finished_by is SOURCE and target.closed and target.led == []


async def test_a_target_that_samples_instead_of_following_takes_over_at_its_first_new_token():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105, 106])),
        lambda: target.put(tokens([105, 106, 107], start=5)),
    ])
    assert got == [[105, 106], [107]] and overlap.took_over and overlap.next_index == 8


async def test_both_streams_ending_unfinished_is_a_failure():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    with pytest.raises(StageFailure, match="both ended"):
        await _drain(overlap, source, [lambda: source.put(None), lambda: target.put(None)])
