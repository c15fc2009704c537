"""Make-before-break (router/overlap.py): a decode handed over live keeps streaming from
its source while its takeover pulls the KV; once the target is ready, the overlap leads it
with every token the client got since the hand-over and races the two streams, cutting
over once the target has caught up (or, after RACE_TOKENS, regardless). The client gets
every output index once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from triptych.router.overlap import RACE_TOKENS, Overlap
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
        self.led_later: list[tuple[int, list[int]]] = []  # the cut's record, not waited for
        self.resumed: tuple[int, list[int]] | None = None
        self.closed = False
        self.refuses_lead = refuses_lead
        self.unread_items: list[object] = []

    async def lead(self, start: int, token_ids: list[int]) -> bool:
        self.led.append((start, list(token_ids)))
        return not self.refuses_lead

    def lead_later(self, start: int, token_ids: list[int]) -> None:
        self.led_later.append((start, list(token_ids)))

    def resume(self, start: int, token_ids: list[int]) -> None:
        self.resumed = (start, list(token_ids))

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


async def test_the_target_is_led_once_ready_and_the_cut_comes_when_it_streams_the_clients_last_token():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106, 107])),
        lambda: target.put(READY),  # pulled and admitted: led at once with what the client got
        lambda: source.put(tokens([108])),  # the source goes on meanwhile
        lambda: target.put(tokens([108], start=8)),  # the target has caught up: level
    ])
    assert got == [[105], [106, 107], [108]]
    assert overlap.took_over and overlap.cut == "level" and overlap.next_index == 9
    assert target.led == [(5, [105, 106, 107])] and not target.closed
    # The cut's record: the target's stream is the client's from index 9 on.
    assert target.led_later == [(5, [105, 106, 107, 108])]
    assert target.resumed == (5, [105, 106, 107, 108])


async def test_a_target_ahead_of_the_source_gives_the_client_its_token_and_the_cut_is_there():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: target.put(READY),
        lambda: target.put(tokens([106, 107], start=6)),  # 106 before the source's: from the target
    ])
    assert got == [[105], [106, 107]] and overlap.took_over and overlap.cut == "ahead"
    assert overlap.next_index == 8 and target.led == [(5, [105])]
    assert target.led_later == [] and target.resumed == (5, [105, 106, 107])  # the lead said index 6 already


async def test_a_target_two_or_more_behind_is_led_again_with_what_it_lacks():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106])),
        lambda: target.put(tokens([105], start=5)),  # one behind: its step in flight samples 106
        lambda: source.put(tokens([107])),
        lambda: source.put(tokens([108])),
        lambda: target.put(tokens([106], start=6)),  # two behind: led again
        lambda: target.put(tokens([109], start=9)),  # it skipped ahead, before the source's 109
    ])
    assert got == [[105], [106], [107], [108], [109]] and overlap.cut == "ahead"
    assert target.led == [(5, []), (5, [105, 106, 107, 108])]


async def test_a_target_whose_tokens_differ_from_the_clients_is_let_go():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105, 106])),
        lambda: target.put(tokens([105, 999], start=5)),
        lambda: source.put(tokens([107]), FinishedEvent(finish_reason="length")),
    ])
    assert got == [[105, 106], [107]] and target.closed and overlap.finished_by is SOURCE
    assert not overlap.took_over


async def test_a_target_streaming_out_of_place_is_let_go():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: target.put(tokens([107], start=7)),  # the client's next index is 5
        lambda: source.put(tokens([105]), FinishedEvent(finish_reason="length")),
    ])
    assert got == [[105]] and target.closed and overlap.finished_by is SOURCE


async def test_the_race_breaks_after_race_tokens_from_the_source_and_the_target_leads_from_the_clients_next():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    ids = [105 + i for i in range(RACE_TOKENS)]
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: target.put(READY),
        *[lambda i=i: source.put(tokens([i])) for i in ids[1:]],  # the target never streams
        lambda: source.put(tokens([105 + RACE_TOKENS])),
    ])
    assert got == [[i] for i in ids] + [[105 + RACE_TOKENS]]
    assert overlap.took_over and overlap.cut == "break" and overlap.next_index == 6 + RACE_TOKENS
    assert target.led == [(5, [105]), (5, [*ids, 105 + RACE_TOKENS])] and target.led_later == []
    assert target.resumed == (5, [*ids, 105 + RACE_TOKENS])


async def test_what_the_target_streams_while_a_breaking_lead_is_in_flight_is_left_for_the_caller():
    """The target may sample before the lead's call returns: that event is put back on
    the takeover (the caller reads it next, less what the client has), never dropped."""
    class QuickTarget(FakeTakeover):
        async def lead(self, start: int, token_ids: list[int]) -> bool:
            if token_ids:
                self.put(tokens([106], start=6))  # sampled at once from the lead
                await asyncio.sleep(0.05)
            return await super().lead(start, token_ids)

    source, target = Stream(), QuickTarget()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105]), FinishedEvent(finish_reason="abort")),  # stopped: the race breaks
    ])
    assert got == [[105]] and overlap.took_over and overlap.cut == "break"
    assert target.unread_items == [tokens([106], start=6)]


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
    assert got == [[105]] and overlap.took_over and overlap.cut == "break" and target.led == [(5, [105])]


async def test_a_source_aborted_after_the_target_is_ready_is_cut_over_from_at_once():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(FinishedEvent(finish_reason="abort")),  # a switch's deadline stopped it
    ])
    # The lead sent when the target was ready already says all: no second one.
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
        lambda: source.put(tokens([105])),
        lambda: target.put(READY),
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
