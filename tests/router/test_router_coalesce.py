"""A response that fell behind its backend catches up in one piece: token events of one
choice already queued are merged (router/event_pump.py `coalesce`), never across choices,
never past a finish, and the end of the stream or a failure stays for `next`."""

from __future__ import annotations

import asyncio

import pytest

from triptych.router.backend import TokenEvent
from triptych.router.event_pump import EventPump, coalesce
from triptych.stage_protocol import TokenLogprob


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
