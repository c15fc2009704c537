"""Make-before-break (router/overlap.py): a decode handed over live keeps streaming from
its source while its takeover pulls the KV; once the target is ready, the overlap cuts
over right after a token from the source, leading the target with every token the client
got since the hand-over. The client gets every output index once, in order."""

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

    def __init__(self, refuses_lead: bool = False) -> None:
        super().__init__()
        self.led: list[tuple[int, list[int]]] = []
        self.closed = False
        self.refuses_lead = refuses_lead
        self.unread_items: list[object] = []

    async def lead(self, start: int, token_ids: list[int]) -> bool:
        self.led.append((start, list(token_ids)))
        return not self.refuses_lead

    def unread(self, item: object) -> None:
        self.unread_items.append(item)

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
    # Every token the client got since the hand-over (index 5 on): the target samples index 9 on.
    assert target.led == [(5, [105, 106, 107, 108])] and not target.closed


async def test_what_the_target_streams_while_the_lead_is_in_flight_is_left_for_the_caller():
    """The target may sample its first token before the lead's call returns: that event
    is put back on the takeover (the caller reads it next), never dropped."""
    class QuickTarget(FakeTakeover):
        async def lead(self, start: int, token_ids: list[int]) -> bool:
            self.put(tokens([106], start=6))  # sampled at once from the lead
            await asyncio.sleep(0.05)
            return await super().lead(start, token_ids)

    source, target = Stream(), QuickTarget()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [lambda: target.put(READY), lambda: source.put(tokens([105]))])
    assert got == [[105]] and overlap.took_over and target.unread_items == [tokens([106], start=6)]


async def test_the_source_finishing_first_ends_the_request():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: source.put(FinishedEvent(finish_reason="length")),
    ])
    assert got == [[105]] and overlap.finished is not None and overlap.finished_by is SOURCE
    assert not overlap.took_over and target.led == []


async def test_a_source_that_fails_before_the_target_is_ready_is_cut_over_from_once_it_is():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105]), StageFailure(SOURCE, "connection reset")),
        lambda: target.put(READY),
    ])
    assert got == [[105]] and overlap.took_over and target.led == [(5, [105])]


async def test_a_source_aborted_after_the_target_is_ready_is_cut_over_from_at_once():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(FinishedEvent(finish_reason="abort")),  # a switch's deadline stopped it
    ])
    assert got == [] and overlap.took_over and target.led == [(5, [])] and overlap.finished is None


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


async def test_a_target_that_does_not_take_the_lead_is_let_go_and_the_source_finishes():
    source, target = Stream(), FakeTakeover(refuses_lead=True)
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106]), FinishedEvent(finish_reason="stop")),
    ])
    assert got == [[105], [106]] and overlap.finished_by is SOURCE and target.closed
    assert target.led == [(5, [105])] and not overlap.took_over


async def test_a_target_ready_only_after_the_source_went_is_cut_over_to_at_once():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105, 106]), None),  # the source's stream ended unfinished
        lambda: target.put(READY),
    ])
    assert got == [[105, 106]] and overlap.took_over and target.led == [(5, [105, 106])]


async def test_both_streams_ending_unfinished_is_a_failure():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    with pytest.raises(StageFailure, match="both ended"):
        await _drain(overlap, source, [lambda: source.put(None), lambda: target.put(None)])
