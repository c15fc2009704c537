"""The stage protocol's events as the orchestrator reads them: one discriminated union
(`type` says which event), parsed from exactly the bytes a worker writes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from triptych.stage_protocol import (
    EncodedEvent,
    EncodedItem,
    ErrorEvent,
    FinishedEvent,
    KVSource,
    MigratingEvent,
    PrefilledEvent,
    TokenLogprob,
    TokensEvent,
    parse_stage_event,
)

# What a worker writes for each event (`event.model_dump_json()`), byte for byte.
WIRE = [
    (EncodedEvent(items=[EncodedItem(content_hash="h", num_tokens=4, handle={"lease": "l1"})]),
     '{"type":"encoded","items":[{"content_hash":"h","num_tokens":4,"handle":{"lease":"l1"}}]}'),
    (TokensEvent(token_ids=[5, 6]), '{"type":"tokens","token_ids":[5,6],"logprobs":null,"index":0,"start":null}'),
    (TokensEvent(token_ids=[5, 6], start=9), '{"type":"tokens","token_ids":[5,6],"logprobs":null,"index":0,"start":9}'),
    (TokensEvent(token_ids=[5], index=2, logprobs=[TokenLogprob(token=5, logprob=-0.5, top=[(5, -0.5), (1, -2.0)])]),
     '{"type":"tokens","token_ids":[5],"logprobs":[{"token":5,"logprob":-0.5,"top":[[5,-0.5],[1,-2.0]]}],"index":2,'
     '"start":null}'),
    (PrefilledEvent(kv=KVSource(handle={"blocks": [1]}, num_tokens=9, first_token=42)),
     '{"type":"prefilled","kv":{"handle":{"blocks":[1]},"num_tokens":9,"first_token":42,"generated":[],'
     '"first_logprob":null,"choices":[]}}'),
    (MigratingEvent(kv=KVSource(handle={"blocks": [1]}, num_tokens=11, first_token=42, generated=[7, 8])),
     '{"type":"migrating","kv":{"handle":{"blocks":[1]},"num_tokens":11,"first_token":42,"generated":[7,8],'
     '"first_logprob":null,"choices":[]},"index":0,"live":false}'),
    (FinishedEvent(finish_reason="stop", timings={"e2e": 0.5}),
     '{"type":"finished","finish_reason":"stop","timings":{"e2e":0.5},"index":0}'),
    (ErrorEvent(status=503, message="KV cache exhausted"),
     '{"type":"error","status":503,"message":"KV cache exhausted"}'),
]


def test_lines_without_the_newer_fields_still_parse() -> None:
    # A worker of the previous release writes no logprobs / index / choices.
    assert parse_stage_event('{"type":"tokens","token_ids":[5,6]}') == TokensEvent(token_ids=[5, 6])
    assert parse_stage_event('{"type":"finished","finish_reason":"stop"}') == FinishedEvent(finish_reason="stop")


@pytest.mark.parametrize(("event", "line"), WIRE, ids=[type(e).__name__ for e, _ in WIRE])
def test_each_event_round_trips_through_the_union(event, line):
    assert event.model_dump_json() == line  # the wire format is unchanged
    parsed = parse_stage_event(line)
    assert type(parsed) is type(event) and parsed == event
    assert parse_stage_event(line.encode()) == event


@pytest.mark.parametrize("line", ['{"type":"telemetry"}', '{"token_ids":[1]}', '{"type":"tokens"}',
                                  "not json", '{"type":"finished","finish_reason":"maybe"}'])
def test_lines_that_are_no_event_are_refused(line):
    with pytest.raises(ValidationError):
        parse_stage_event(line)
