"""A response that fell behind its backend catches up in one piece: token events of one
choice already queued are merged (router/event_pump.py `coalesce`), never across choices,
never past a finish, and the end of the stream or a failure stays for `next`."""

from __future__ import annotations

import asyncio

import pytest

from triptych.router import event_pump
from triptych.router.backend import TokenEvent
from triptych.router.event_pump import EventPump, coalesce
from triptych.stage_protocol import TokenLogprob


@pytest.fixture(autouse=True)
def _no_first_write_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # These responses fell behind from the start: the pump does not hold its first event
    # for the response's first write (`_first_written`; tested below with the wait on).
    monkeypatch.setattr(event_pump, "FIRST_WRITE_WAIT_S", 0)


async def _queued(events: list[object]) -> EventPump:
    async def gen():
        for e in events:
            if isinstance(e, BaseException):
                raise e
            yield e

    pump = EventPump(gen(), abort_timeout_s=1)
    for _ in range(20):  # let the pump's task queue everything
        await asyncio.sleep(0)
    return pump


async def test_queued_events_of_one_choice_merge_up_to_the_finish() -> None:
    pump = await _queued([TokenEvent([1]), TokenEvent([2, 3]), TokenEvent([4], finish_reason="length"),
                          TokenEvent([9], index=1)])
    merged = coalesce(await pump.next(), pump)
    assert (merged.token_ids, merged.finish_reason, merged.index) == ([1, 2, 3, 4], "length", 0)
    other = coalesce(await pump.next(), pump)
    assert (other.token_ids, other.index) == ([9], 1)
    assert await pump.next() is None
    await pump.close()


async def test_another_choice_stops_the_merge_and_stays_next() -> None:
    pump = await _queued([TokenEvent([1]), TokenEvent([5], index=1), TokenEvent([2])])
    first = coalesce(await pump.next(), pump)
    assert first.token_ids == [1]
    assert (await pump.next()).index == 1
    assert (await pump.next()).token_ids == [2]
    await pump.close()


async def test_logprobs_are_merged_with_their_tokens() -> None:
    lp = [TokenLogprob(token=t, logprob=-float(t)) for t in (1, 2)]
    pump = await _queued([TokenEvent([1], logprobs=lp[:1]), TokenEvent([2], logprobs=lp[1:])])
    merged = coalesce(await pump.next(), pump)
    assert merged.token_ids == [1, 2] and [e.token for e in merged.logprobs] == [1, 2]
    await pump.close()


async def test_a_failure_behind_the_tokens_is_still_raised() -> None:
    pump = await _queued([TokenEvent([1]), TokenEvent([2]), RuntimeError("backend gone")])
    assert coalesce(await pump.next(), pump).token_ids == [1, 2]
    with pytest.raises(RuntimeError, match="backend gone"):
        await pump.next()
    await pump.close()


async def test_the_backend_goes_on_once_the_first_event_was_written(monkeypatch: pytest.MonkeyPatch) -> None:
    # After a prefill's hand-over the backend dispatches the decode hop: the response's
    # first write goes first, then the backend is pulled again.
    monkeypatch.setattr(event_pump, "FIRST_WRITE_WAIT_S", 5)
    pulled: list[int] = []

    async def gen():
        for t in (1, 2, 3):
            pulled.append(t)
            yield TokenEvent([t])

    pump = EventPump(gen(), abort_timeout_s=1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert pulled == [1]  # held after the first event
    assert (await pump.next()).token_ids == [1]
    for _ in range(20):
        await asyncio.sleep(0)
    assert pulled == [1]  # taken, not yet written: the consumer has not come back
    assert (await pump.next()).token_ids == [2] and pulled == [1, 2, 3]
    await pump.close()


async def test_the_first_write_wait_is_bounded_and_ends_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_pump, "FIRST_WRITE_WAIT_S", 0.05)

    async def gen():
        yield TokenEvent([1])
        yield TokenEvent([2], finish_reason="length")

    pump = EventPump(gen(), abort_timeout_s=1)
    await asyncio.sleep(0.2)  # nobody reads: the backend goes on after 50 ms
    assert coalesce(await pump.next(), pump).token_ids == [1, 2]
    monkeypatch.setattr(event_pump, "FIRST_WRITE_WAIT_S", 30)
    held = EventPump(gen(), abort_timeout_s=1)
    assert (await held.next()).token_ids == [1]  # e.g. a response that ended at its first event
    await asyncio.wait_for(held.close(grace_s=5), 1)  # close ends the wait: no 30 s
    await pump.close()
