"""The worker's per-stage latency breakdown (queue / exec per stage) from request timings."""

from triptych.topology import Stage
from triptych.worker.metrics import stage_breakdown


def test_aggregated_request() -> None:
    t = {"arrival": 10.0, "first_scheduled": 10.5, "encode_start": 10.5, "encode_end": 11.0,
         "prefill_start": 11.25, "prefill_end": 12.0, "first_token": 12.0, "finished": 14.0}
    got = stage_breakdown({Stage.ENCODE, Stage.PREFILL, Stage.DECODE}, t)
    assert got == {("encode", "queue"): 0.5, ("encode", "exec"): 0.5, ("prefill", "queue"): 0.25,
                   ("prefill", "exec"): 0.75, ("decode", "exec"): 2.0}


def test_decode_only_request_has_a_decode_queue() -> None:
    t = {"arrival": 1.0, "first_scheduled": 1.25, "first_token": 1.5, "finished": 3.0}
    assert stage_breakdown({Stage.DECODE}, t) == {("decode", "queue"): 0.25, ("decode", "exec"): 1.75}


def test_encode_only_request() -> None:
    t = {"arrival": 0.0, "encode_start": 0.125, "encode_end": 0.5}
    assert stage_breakdown({Stage.ENCODE}, t) == {("encode", "queue"): 0.125, ("encode", "exec"): 0.375}
