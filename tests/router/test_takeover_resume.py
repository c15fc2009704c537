"""After a live hand-over's cut (router/overlap.py), `Takeover.events` drops the target's
tokens the client already has, and fails the hop on one that is not the client's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from triptych.router.overhead import WaitClock
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.takeover import Takeover
from triptych.stage_protocol import (
    FinishedEvent,
    KVSource,
    SamplingParams,
    StageEvent,
    StageRequest,
    TokensEvent,
)
from triptych.topology import InstanceType, Stage

TARGET = Instance(url="http://d1", role=InstanceType.D)


class Stages:
    """A StageClient whose hop at the target streams `events`."""

    feeds = None

    def __init__(self, events: list[StageEvent]) -> None:
        self.events = events

    async def run(self, *_: Any, **__: Any) -> AsyncIterator[StageEvent]:
        for event in self.events:
            yield event


def _takeover(events: list[StageEvent]) -> Takeover:
    sreq = StageRequest(request_id="r.t1", stages=[Stage.DECODE], prompt_token_ids=[1, 2, 3],
                        kv_source=KVSource(handle={}, num_tokens=3, first_token=7), sampling=SamplingParams())
    return Takeover(Stages(events), TARGET, sreq, 5.0, WaitClock())  # type: ignore[arg-type]


async def _read(takeover: Takeover) -> list[StageEvent]:
    return [event async for event in takeover.events()]


async def test_the_targets_tokens_the_client_has_are_dropped_and_the_rest_go_on_from_their_index():
    takeover = _takeover([TokensEvent(token_ids=[105], start=5), TokensEvent(token_ids=[106, 107, 108], start=6),
                          TokensEvent(token_ids=[109], start=9), FinishedEvent(finish_reason="length")])
    takeover.resume(5, [105, 106, 107])  # the client has indices 5..7 since the hand-over
    assert await _read(takeover) == [TokensEvent(token_ids=[108], start=8), TokensEvent(token_ids=[109], start=9),
                                     FinishedEvent(finish_reason="length")]


async def test_a_target_token_that_is_not_the_clients_fails_the_hop():
    takeover = _takeover([TokensEvent(token_ids=[105, 999], start=5)])
    takeover.resume(5, [105, 106])
    with pytest.raises(StageFailure, match="differ from what the client got"):
        await _read(takeover)


async def test_without_a_cut_every_token_goes_on():
    events = [TokensEvent(token_ids=[], start=5), TokensEvent(token_ids=[105], start=5)]
    assert await _read(_takeover(events)) == events
