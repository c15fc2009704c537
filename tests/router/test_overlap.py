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
from triptych.router.takeover import CutGate
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

    def __init__(self, refuses_lead: bool = False, gate: CutGate | None = None) -> None:
        super().__init__()
        self.gate = gate or CutGate()
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


async def test_a_cut_waits_for_its_turn_at_the_target_and_the_stream_goes_on_meanwhile():
    """A switch's moved decodes cut over one at a time (`CutGate`): while another decode's
    cut-over holds the target's gate, this one keeps relaying its source's tokens; the first
    source token after the gate is free is its cut."""
    gate = CutGate()
    assert gate.take("other.t1")
    source, target = Stream(), FakeTakeover(gate=gate)
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105])),  # due, but not its turn
        lambda: gate.release("other.t1"),  # the other's target streamed its first token
        lambda: source.put(tokens([106])),
    ])
    assert got == [[105], [106]] and overlap.took_over and target.led == [(5, [105, 106])]
    assert not gate.take("next.t1")  # held by this cut-over now (until its first token)


async def test_a_source_gone_is_cut_over_from_whatever_the_gate_says():
    gate = CutGate()
    assert gate.take("other.t1")
    source, target = Stream(), FakeTakeover(gate=gate)
    overlap = overlap_of(target)
    got = await _drain(overlap, source, [
        lambda: target.put(READY),
        lambda: source.put(tokens([105]), FinishedEvent(finish_reason="abort")),
    ])
    assert got == [[105]] and overlap.took_over and target.led == [(5, [105])]


def test_a_cut_gate_is_held_by_one_cut_over_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from triptych.router import takeover

    gate = CutGate()
    assert gate.take("a") and gate.take("a") and not gate.take("b")
    gate.release("b")  # not the holder: nothing
    assert not gate.take("b")
    gate.release("a")
    assert gate.take("b")
    monkeypatch.setattr(takeover, "CUT_GATE_HOLD_S", 0.0)  # a holder that never let go: timed out
    assert gate.take("c")


async def test_a_takeover_holds_its_gate_from_its_lead_until_its_first_token_or_its_close():
    """The real `Takeover` (over a stub stage client): the cut-over holds the target's
    gate through the lead's call and the target's step, and lets it go at the first token
    it reads from the target (or when it is closed, or the target does not take the lead)."""
    import httpx

    from triptych.router.overhead import WaitClock
    from triptych.router.takeover import Takeover
    from triptych.stage_protocol import StageRequest
    from triptych.topology import Stage

    class StubStages:
        def __init__(self, lead_status: int) -> None:
            self.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(lead_status)))
            self.events: asyncio.Queue[StageEvent] = asyncio.Queue()

        async def run(self, target, sreq, read_timeout_s, waits, path, content) -> AsyncIterator[StageEvent]:
            while True:
                yield await self.events.get()

    def takeover_on(stages: StubStages, gate: CutGate, request_id: str) -> Takeover:
        sreq = StageRequest(request_id=request_id, stages=[Stage.DECODE], prompt_token_ids=[1, 2, 3], kv_source=KV)
        return Takeover(stages, TARGET, sreq, 5.0, WaitClock(), gate)  # type: ignore[arg-type]

    gate, stages = CutGate(), StubStages(204)
    first = takeover_on(stages, gate, "a.t1")
    assert gate.take("a.t1") and await first.lead(5, [105])
    stages.events.put_nowait(READY)
    events = first.events()
    assert await asyncio.wait_for(anext(events), 5) == READY and not gate.take("b.t1")  # no token yet
    stages.events.put_nowait(tokens([106], start=6))
    assert (await asyncio.wait_for(anext(events), 5)).token_ids == [106] and gate.take("b.t1")
    first.close()

    second = takeover_on(stages, gate, "b.t1")  # holds it (taken above): closing lets go
    second.close()
    assert gate.take("c.t1")
    refused = takeover_on(StubStages(404), gate, "c.t1")  # the target ran no such takeover
    assert not await refused.lead(5, []) and gate.take("d.t1")
    refused.close()
