"""The stage protocol's msgspec fast path for `tokens` events reads and writes the same
JSON as the pydantic models, and refuses what they refuse."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from triptych.stage_protocol import (
    FinishedEvent,
    StageFrameError,
    StageRequest,
    TokenLogprob,
    TokensEvent,
    decode_stage_request,
    encode_stage_event,
    encode_stage_request,
    parse_stage_event,
)


@pytest.mark.parametrize("event", [
    TokensEvent(token_ids=[5, 6, 7]),
    TokensEvent(token_ids=[1], index=3),
    TokensEvent(token_ids=[4, 5], start=17),  # a fed decode's tokens carry their output index
    TokensEvent(token_ids=[2, 3], logprobs=[TokenLogprob(token=2, logprob=-0.5, top=[(2, -0.5)]),
                                            TokenLogprob(token=3, logprob=-1.0)]),
    FinishedEvent(finish_reason="length", timings={"decode": 0.25}, index=1),
])
def test_round_trip_and_same_json_as_pydantic(event) -> None:
    line = encode_stage_event(event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_stage_event(line) == event
    assert parse_stage_event(event.model_dump_json()) == event  # what an older worker writes
    ours = json.loads(line)
    assert {k: v for k, v in json.loads(event.model_dump_json()).items() if v is not None} == \
        {k: v for k, v in ours.items() if v is not None}


@pytest.mark.parametrize("line", [
    b'{"type":"tokens","token_ids":["x"]}',
    b'{"type":"tokens","token_ids":[1],"index":1.5}',
    b'{"type":"tokens"}',
    b'{"type":"tokens","token_ids":[1]',
    b'{"type":"token","token_ids":[1]}',
    b'{"type":"tokens","token_ids":[1],"start":-1}',
])
def test_malformed_tokens_lines_are_refused(line: bytes) -> None:
    with pytest.raises(ValidationError):
        parse_stage_event(line)


FRAMED = StageRequest(request_id="r1", stages=["encode", "prefill"], prompt_token_ids=[1, 2, 3],
                      images={"h1": bytes(range(256)) * 3, "h2": b"", "h3": b"\n{\"x\":1}"})


def test_stage_frame_round_trip_carries_raw_bytes() -> None:
    frame = encode_stage_request(FRAMED)
    back = decode_stage_request(frame)
    assert back == FRAMED and back.images == FRAMED.images
    assert bytes(range(256)) * 3 in frame  # raw, not base64
    head_len = int.from_bytes(frame[:4], "big")
    assert "images" not in json.loads(frame[4:4 + head_len])  # never inside the JSON
    no_images = StageRequest(request_id="r2", stages=["decode"], prompt_token_ids=[4])
    assert decode_stage_request(encode_stage_request(no_images)) == no_images


@pytest.mark.parametrize("cut", [2, 10, -1, -300])
def test_stage_frame_cut_short_is_refused(cut: int) -> None:
    frame = encode_stage_request(FRAMED)
    with pytest.raises(StageFrameError):
        decode_stage_request(frame[:cut])


def test_json_images_are_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="binary tail"):
        StageRequest.model_validate_json(json.dumps({"request_id": "r", "stages": ["encode"],
                                                     "prompt_token_ids": [1], "images": {"h": "aGk="}}))
