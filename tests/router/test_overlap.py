"""Make-before-break (router/overlap.py): a decode handed over live keeps streaming from
its source while its takeover pulls the KV; once the target is ready, the overlap feeds it
what it lacks until it is at most CUT_BEHIND tokens behind, then cuts over right after a
token from the source, leading the target with every token the client got since the
hand-over. The client gets every output index once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from triptych.router.overlap import MAX_CATCH_UPS, Overlap
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

    def __init__(self, refuses_lead: bool = False, refuses_feeds: bool = False) -> None:
        super().__init__()
        self.led: list[tuple[int, list[int]]] = []
        self.fed: list[tuple[int, list[int]]] = []  # catch-up feeds (no lead)
        self.closed = False
        self.refuses_lead, self.refuses_feeds = refuses_lead, refuses_feeds
        self.unread_items: list[object] = []

    async def feed(self, start: int, token_ids: list[int], lead: bool = False) -> bool:
        (self.led if lead else self.fed).append((start, list(token_ids)))
        return not (self.refuses_lead if lead else self.refuses_feeds)

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
        lambda: target.put(READY),  # pulled and admitted: following, one token behind
        lambda: source.put(tokens([106])),  # relayed, then the cut (it lacks two)
    ])
    assert got == [[105], [106]]
    assert overlap.took_over and overlap.finished is None and overlap.next_index == 7
    # Every token the client got since the hand-over (index 5 on): the target samples index 7 on.
    assert target.led == [(5, [105, 106])] and target.fed == [] and not target.closed


async def test_a_target_far_behind_is_caught_up_before_the_cut_while_the_client_reads_the_source():
    """Tokens the source streamed during the pull and admission are fed without the lead
    (the target computes them off the client's stream, and says so with an empty event);
    the cut waits until the target lacks at most CUT_BEHIND tokens."""
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105]), tokens([106, 107]), tokens([108])),
        lambda: target.put(READY),  # holds 5 tokens; the client has 9: a catch-up round
        lambda: source.put(tokens([109])),  # no cut: the round is not in yet
        lambda: target.put(TokensEvent(token_ids=[], start=9)),  # computed 105-108: lacks 109
        lambda: source.put(tokens([110])),  # lacks 2: the cut, right after this token
    ])
    assert got == [[105], [106, 107], [108], [109], [110]] and overlap.took_over
    assert target.fed == [(5, [105, 106, 107, 108])] and overlap.catch_ups == 1
    assert target.led == [(9, [109, 110])]  # from what it holds: the cut's step computes 2 tokens


async def test_catching_up_is_bounded_and_a_target_that_refuses_a_feed_is_let_go():
    # A round the target never confirms: no cut; the source finishing first ends the request.
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    behind = [tokens([100 + i]) for i in range(5, 9)]
    got = await _drain(overlap, source, [
        lambda: source.put(*behind), lambda: target.put(READY),
        lambda: source.put(tokens([109])), lambda: source.put(FinishedEvent(finish_reason="length")),
    ])
    assert len(got) == 5 and overlap.finished_by is SOURCE and len(target.fed) == 1 and target.led == []
    # A round that leaves the target as far behind (its steps slower than the source's): no
    # more rounds, the cut comes right after the next token.
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    await _drain(overlap, source, [
        lambda: source.put(*behind), lambda: target.put(READY),  # lacks 4: a round
        lambda: source.put(*[tokens([200 + j]) for j in range(4)]),  # 4 more while it runs
        lambda: target.put(TokensEvent(token_ids=[], start=overlap._fed_to)),  # in; lacks 4 again
        lambda: source.put(tokens([300]), tokens([301])),
    ])
    assert overlap.took_over and overlap.catch_ups == 1 and target.led == [(9, [200, 201, 202, 203, 300])]
    # Rounds that keep gaining stop after MAX_CATCH_UPS.
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    steps = [lambda: source.put(*[tokens([400 + j]) for j in range(20)]), lambda: target.put(READY)]
    for i, more in enumerate((15, 10, 6, 5)):  # streamed while each round runs: fewer each time
        steps += [lambda i=i, more=more: source.put(*[tokens([500 + 20 * i + j]) for j in range(more)]),
                  lambda: target.put(TokensEvent(token_ids=[], start=overlap._fed_to))]
    steps.append(lambda: source.put(tokens([600])))
    await _drain(overlap, source, steps)
    assert overlap.took_over and overlap.catch_ups == MAX_CATCH_UPS and len(target.fed) == MAX_CATCH_UPS
    # The cut came at the first token after the last round was sent (not waiting for it): the
    # lead brings every token from what the target was known to hold to the client's last.
    start, led = target.led[0]
    assert start == target.fed[-1][0] and start + len(led) == overlap.next_index
    # A catch-up feed the target refuses: it is let go at the next token, the source finishes.
    source, target = Stream(), FakeTakeover(refuses_feeds=True)
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(*behind), lambda: target.put(READY),
        lambda: source.put(tokens([109])), lambda: source.put(tokens([110]), FinishedEvent(finish_reason="stop")),
    ])
    assert target.closed and target.led == [] and overlap.finished_by is SOURCE and not overlap.took_over


async def test_what_the_target_streams_while_the_lead_is_in_flight_is_left_for_the_caller():
    """The target may sample its first token before the lead's call returns: that event
    is put back on the takeover (the caller reads it next), never dropped."""
    class QuickTarget(FakeTakeover):
        async def feed(self, start: int, token_ids: list[int], lead: bool = False) -> bool:
            self.put(tokens([106], start=6))  # sampled at once from the lead
            await asyncio.sleep(0.05)
            return await super().feed(start, token_ids, lead)

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
