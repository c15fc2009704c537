"""Make-before-break (router/overlap.py): a decode handed over live keeps streaming from
its source while its takeover pulls the KV and samples alongside, fed every token the
source streams; the overlap cuts over once the target has caught up (a token the client
lacks comes from the target, or the target is level with the client), checking every
target token against what the client got. The client gets every output index once, in
order. Also the takeover's parts the overlap leans on: `past_expected` (what a target
streams after the cut) and `Feeder` (one feed call at a time per instance)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from triptych.router.overlap import MAX_BEHIND, Overlap
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.takeover import Feeder, past_expected
from triptych.stage_protocol import (
    FeedBatch,
    FeedRequest,
    FinishedEvent,
    KVSource,
    MigratingEvent,
    StageEvent,
    TokenLogprob,
    TokensEvent,
)
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

    def __init__(self) -> None:
        super().__init__()
        self.fed: list[tuple[int, list[int]]] = []
        self.led: list[tuple[int, list[int]]] = []
        self.expected: tuple[int, list[int]] | None = None
        self.closed = False
        self.unread_items: list[object] = []

    def feed(self, start: int, token_ids: list[int], lead: bool = False) -> None:
        (self.led if lead else self.fed).append((start, list(token_ids)))

    def expect(self, start: int, token_ids: list[int]) -> None:
        self.expected = (start, list(token_ids))

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


async def test_the_source_streams_and_feeds_the_target_until_it_is_level_then_the_cut():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: source.put(tokens([106, 107])),
        lambda: target.put(READY),  # pulled and admitted
        lambda: target.put(tokens([105], start=5)),  # its first sample: behind the client (at 8)
        lambda: source.put(tokens([108])),
        lambda: target.put(tokens([106, 107, 108], start=6)),  # took in the feeds: level, the cut
    ])
    assert got == [[105], [106, 107], [108]]
    assert overlap.took_over and overlap.finished is None and overlap.next_index == 9 and overlap.cut_index == 9
    assert target.fed == [(5, [105]), (6, [106, 107]), (8, [108])]  # each source token, by output index
    # The cut is recorded with every token the client got since the hand-over (index 5 on).
    assert target.led == [(5, [105, 106, 107, 108])] and target.expected == (5, [105, 106, 107, 108])
    assert not target.closed


async def test_a_target_that_says_it_samples_the_clients_next_index_is_cut_over_to():
    """After a step in which it took fed tokens in, the target says which output index it
    samples next (an event without tokens): the client's next one is the cut."""
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105, 106])),
        lambda: target.put(READY),
        lambda: target.put(TokensEvent(token_ids=[], start=6)),  # behind: not yet
        lambda: source.put(tokens([107])),
        lambda: target.put(TokensEvent(token_ids=[], start=8)),  # level
    ])
    assert got == [[105, 106], [107]] and overlap.took_over and overlap.cut_index == 8
    assert target.led == [(5, [105, 106, 107])]


async def test_a_target_level_when_ready_races_the_source_with_its_first_step():
    """Ready while the client has nothing new since the hand-over: no cut yet (its first
    step, the one it joins in, is slower than any after it); its first token decides."""
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),  # it would sample index 5 next
        lambda: source.put(tokens([105])),  # the source's step was quicker
        lambda: target.put(tokens([105], start=5)),  # level: its next step samples index 6
    ])
    assert got == [[105]] and overlap.took_over and overlap.cut_index == 6 and target.led == [(5, [105])]


async def test_a_target_ahead_of_the_source_gives_the_client_its_token_at_once():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    lps = [TokenLogprob(token=105, logprob=-0.5), TokenLogprob(token=106, logprob=-0.25)]
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: target.put(READY, TokensEvent(token_ids=[105, 106], start=5, logprobs=lps)),
    ])
    assert got == [[105], [106]] and overlap.took_over and overlap.cut_index == 6 and overlap.next_index == 7
    assert target.led == [(5, [105])] and target.expected == (5, [105, 106])


async def test_a_target_that_samples_another_token_is_let_go_and_the_source_finishes():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105, 106])),
        lambda: target.put(READY, tokens([105, 999], start=5)),  # index 6: not the client's 106
        lambda: source.put(tokens([107])),
        lambda: source.put(FinishedEvent(finish_reason="stop")),
    ])
    assert got == [[105, 106], [107]] and overlap.finished_by is SOURCE and target.closed
    assert not overlap.took_over and target.led == [] and target.fed == [(5, [105, 106])]  # none once it went


async def test_a_target_whose_tokens_skip_an_index_is_let_go():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: source.put(tokens([105])),
        lambda: target.put(READY, tokens([107], start=7)),  # index 6 never came
        lambda: source.put(tokens([106]), FinishedEvent(finish_reason="stop")),
    ])
    assert got == [[105], [106]] and target.closed and overlap.finished_by is SOURCE


async def test_a_target_that_stays_behind_is_cut_over_to_after_max_behind_of_its_tokens():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    ahead = list(range(105, 105 + MAX_BEHIND + 4))  # the client has indices 5..16
    before_last: list[bool] = []
    steps = [lambda: source.put(tokens(ahead)), lambda: target.put(READY)]
    steps += [lambda k=k: target.put(tokens([105 + k], start=5 + k)) for k in range(MAX_BEHIND - 1)]
    steps += [lambda: before_last.append(overlap.took_over),
              lambda: target.put(tokens([105 + MAX_BEHIND - 1], start=5 + MAX_BEHIND - 1))]
    got = await _drain(overlap, source, steps)
    assert got == [ahead] and before_last == [False]
    assert overlap.took_over and overlap.cut_index == 5 + len(ahead) and target.led == [(5, ahead)]


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
    assert got == [[105], [106]] and overlap.finished_by is SOURCE and target.led == [] and target.fed == []


async def test_a_target_moving_on_before_the_cut_is_let_go():
    source, target = Stream(), FakeTakeover()
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(MigratingEvent(kv=KV, live=True)),
        lambda: source.put(tokens([105]), FinishedEvent(finish_reason="stop")),
    ])
    assert target.closed and got == [[105]] and overlap.finished_by is SOURCE


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


def test_after_the_cut_what_the_target_streams_of_the_clients_tokens_is_checked_and_dropped():
    had = [105, 106, 107]  # the client's, from index 5
    assert past_expected(tokens([106, 107], start=6), 5, had, TARGET) is None
    rest = past_expected(TokensEvent(token_ids=[107, 108, 109], start=7, logprobs=[
        TokenLogprob(token=t, logprob=-1.0) for t in (107, 108, 109)]), 5, had, TARGET)
    assert rest is not None and rest.token_ids == [108, 109] and rest.start == 8
    assert [lp.token for lp in rest.logprobs or []] == [108, 109]
    assert past_expected(tokens([108], start=8), 5, had, TARGET) == tokens([108], start=8)
    with pytest.raises(StageFailure, match="sampled token 999 at output index 6 where the stream has 106"):
        past_expected(tokens([999, 107], start=6), 5, had, TARGET)


async def test_a_feeder_sends_one_call_at_a_time_with_what_came_meanwhile():
    calls: list[list[tuple[str, int]]] = []
    gate = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        batch = FeedBatch.model_validate_json(request.content)
        calls.append([(f.request_id, f.start) for f in batch.feeds])
        if len(calls) == 1:
            await gate.wait()  # the first call is out while three more feeds come
        return httpx.Response(200, json={"taken": [f.request_id != "gone" for f in batch.feeds]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        feeder = Feeder(client, "http://d1")
        first = feeder.send(FeedRequest(request_id="a", start=5, token_ids=[1]))
        await asyncio.sleep(0.01)
        later = [feeder.send(FeedRequest(request_id=r, start=6, token_ids=[2])) for r in ("a", "b", "gone")]
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, *later), 5) == [True, True, True, False]
    assert calls == [[("a", 5)], [("a", 6), ("b", 6), ("gone", 6)]]


async def test_a_feed_call_that_fails_takes_nothing():
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "switching"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        taken = Feeder(client, "http://d1").send(FeedRequest(request_id="a", start=5, token_ids=[1]))
        assert await asyncio.wait_for(taken, 5) is False
