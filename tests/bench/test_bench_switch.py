"""`triptych bench switch`: the added-gap figure of a stream, and the command end to end
on a small local deployment (every switch answered with its phase times, no request lost)."""

from __future__ import annotations

import json

import pytest

from triptych.bench.stats import RequestResult
from triptych.bench.switch import (
    HOP_PARTS,
    _max_hop_gap,
    added_gaps,
    hop_breakdown,
    hop_gap,
    hop_gap_at_target,
    hop_parts,
    hop_span,
)
from triptych.cli import main


def test_added_gaps_counts_the_pause_in_mean_gaps() -> None:
    steady = RequestResult(ttft=0.1, e2e=0.3, gaps=[0.01] * 20, num_tokens=21)
    assert added_gaps(steady) == pytest.approx(0.0)
    # 20 gaps of 10 ms and one of 220 ms: TPOT 20 ms, the pause 10 TPOTs more than usual
    paused = RequestResult(ttft=0.1, e2e=0.1 + 0.2 + 0.22, gaps=[0.01] * 20 + [0.22], num_tokens=22)
    assert added_gaps(paused) == pytest.approx(10.0)
    assert added_gaps(RequestResult(ttft=0.1, e2e=0.2, gaps=[0.01, 0.02], num_tokens=3)) is None
    assert added_gaps(RequestResult(error="HTTP 503")) is None


def _stream(times: list[float], request_id: str = "moved") -> RequestResult:
    return RequestResult(ttft=times[0], e2e=times[-1], gaps=[b - a for a, b in zip(times, times[1:], strict=False)],
                         num_tokens=len(times), sent_at=100.0, token_times=times, request_id=request_id)


def test_the_hop_gap_runs_from_the_last_token_at_the_old_instance_to_the_first_at_the_new() -> None:
    # Tokens 10 ms apart; the stream moved after its 10th token, and the old instance's last
    # step (the 10th token) came 30 ms late: the hop is then one 50 ms pause (10th -> 11th).
    times = [0.1 + 0.01 * i for i in range(9)] + [0.21] + [0.26 + 0.01 * i for i in range(10)]
    r = _stream(times)
    tpot = r.tpot
    assert hop_span(r, 10) == pytest.approx((100.21, 100.26))
    assert hop_gap(r, 10) == pytest.approx((0.05 - tpot) / tpot)
    # not the gap before it (the old instance's late step), as a gap spanning the park would be
    assert hop_gap(r, 9) == pytest.approx((0.03 - tpot) / tpot)
    assert hop_gap(r, 20) is None and hop_gap(r, 0) is None  # the stream never got that far
    assert added_gaps(r, since=100.27) == pytest.approx((0.01 - tpot) / tpot)  # the pause came before
    assert added_gaps(r, since=100.0) == pytest.approx(added_gaps(r))


def test_a_switchs_added_gaps_leave_out_the_streams_admission() -> None:
    # A stream admitted just before the switch: its first decode token came 300 ms after its
    # prefill's (the P -> D hop of its admission, behind a burst), 10 ms gaps since; the
    # switch was asked while that first gap was under way. Its admission is not the switch's.
    times = [0.1, 0.4] + [0.4 + 0.01 * i for i in range(1, 20)]
    r = _stream(times)
    assert added_gaps(r) == pytest.approx((0.3 - r.tpot) / r.tpot)  # the whole stream: it counts
    assert added_gaps(r, since=100.2) == pytest.approx((0.01 - r.tpot) / r.tpot)  # the switch's: it does not
    # a pause after the admission still counts
    paused = _stream(times[:10] + [t + 0.2 for t in times[10:]])
    assert added_gaps(paused, since=100.2) == pytest.approx((0.21 - paused.tpot) / paused.tpot)


def test_a_live_hand_over_hops_where_the_router_cut_over() -> None:
    # Handed over live after 10 tokens, the source streamed on; the router cut over to the
    # target at output index 14: the gap before token 14 (25 ms) is the hop, not the one
    # at the hand-over.
    times = [0.1 + 0.01 * i for i in range(14)] + [0.255 + 0.01 * i for i in range(6)]
    r = _stream(times)
    tpot = r.tpot
    assert hop_span(r, 10, cut=14) == pytest.approx((100.23, 100.255))
    assert hop_gap(r, 10, cut=14) == pytest.approx((0.025 - tpot) / tpot)
    assert hop_gap(r, 10) == pytest.approx((0.01 - tpot) / tpot)  # the hand-over's own gap: none added
    assert hop_span(r, 10, cut=40) is None  # the stream never got there
    assert _max_hop_gap([r], {"moved": 10}, {"moved": 14}) == round((0.025 - tpot) / tpot, 2)


def test_the_hop_counted_in_the_streams_gaps_at_its_new_instance() -> None:
    # 10 ms gaps before the hop, a 60 ms hop after the 10th token, 20 ms gaps after it (the
    # new instance runs a bigger batch): the hop is 2 of the new gaps more than one.
    times = [0.1 + 0.01 * i for i in range(10)] + [0.25 + 0.02 * i for i in range(10)]
    r = _stream(times)
    assert hop_gap_at_target(r, 10) == pytest.approx((0.06 - 0.02) / 0.02)
    assert hop_gap(r, 10) == pytest.approx((0.06 - r.tpot) / r.tpot)  # in the whole stream's TPOT
    assert hop_gap_at_target(r, 19) is None  # no gap after its first token there
    assert hop_gap_at_target(r, 30) is None  # never got that far


def test_the_net_hop_gap_discounts_a_stall_every_stream_had_at_the_hop() -> None:
    def stream(pause_after: int, pause_s: float, request_id: str = "other") -> RequestResult:
        times = [0.1 + 0.01 * i for i in range(pause_after)]
        times += [times[-1] + pause_s + 0.01 * i for i in range(20 - pause_after)]
        return _stream(times, request_id)

    moved = stream(10, 0.08, "moved")  # the hop: an 80 ms pause after its 10th token
    stalled = [stream(10, 0.05), stream(10, 0.06), stream(10, 0.01)]  # two others stalled too
    tpot = moved.tpot
    assert _max_hop_gap([moved], {"moved": 10}, {}) == round((0.08 - tpot) / tpot, 2)
    # net of the others' median pause at that moment (50 ms), not of one TPOT
    assert _max_hop_gap([moved], {"moved": 10}, {}, stalled) == round((0.08 - 0.05) / tpot, 2)
    # others that paused less than a TPOT leave the plain hop gap
    calm = [stream(10, 0.001)] * 3
    assert _max_hop_gap([moved], {"moved": 10}, {}, calm) == _max_hop_gap([moved], {"moved": 10}, {})
    assert _max_hop_gap([moved], {"moved": 10}, {}, []) is None  # nothing to compare with
    assert _max_hop_gap([moved], {}, {}) is None  # not among the moved ones


def test_the_hop_splits_at_the_hand_over_and_the_targets_first_token() -> None:
    moments = {"opened_at": 49.0, "precopied_at": 49.5, "handed_over_at": 50.012, "admitted_at": 50.015,
               "first_token_at": 50.030}
    assert hop_parts(50.0, moments, 50.033) == pytest.approx(
        {"park_to_handover": 0.012, "handover_to_admitted": 0.003, "admitted_to_first_token": 0.015,
         "first_token_to_client": 0.003})
    assert hop_parts(None, moments, 50.033) is None  # no park on record
    assert hop_parts(50.0, {**moments, "first_token_at": None}, 50.033) is None
    # Two moved streams (one without its target's moments) and one that stayed; the client's
    # perf_counter arrivals (sent_at 100 + token times) are 900 s behind the wall clock here.
    times = [0.1 + 0.01 * i for i in range(10)] + [0.24 + 0.01 * i for i in range(10)]
    moved, lost = _stream(times, "a"), _stream(times, "b")
    first_at_client = 100.0 + 0.24 + 900.0
    takeovers = {"a": {**moments, "handed_over_at": first_at_client - 0.02, "admitted_at": first_at_client - 0.018,
                       "first_token_at": first_at_client - 0.004}}
    split = hop_breakdown([moved, lost, _stream(times, "c")], {"a": 10, "b": 10}, {}, first_at_client - 0.03,
                          takeovers, 900.0)
    assert split is not None and set(split) == set(HOP_PARTS)
    assert split == pytest.approx({"park_to_handover": 0.01, "handover_to_admitted": 0.002,
                                   "admitted_to_first_token": 0.014, "first_token_to_client": 0.004}, abs=1e-6)
    assert hop_breakdown([lost], {"b": 10}, {}, 1.0, takeovers, 900.0) is None


@pytest.mark.slow
def test_bench_switch_runs_the_cycle_and_loses_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "switch", "--topology", "1E1P2D", "--concurrency", "4", "--output-len", "24",
                 "--images", "0", "--settle", "1.0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["switches"]
    assert [r["loaded"] for r in rows] == [False] * 4 + [True] * 4
    assert [r["switch"].split("->")[-1] for r in rows] == ["P", "D", "D", "E"] * 2
    for r in rows:
        assert r["total_s"] > 0 and r["failed"] == 0, r
        # A live P <-> D switch's pre-copy comes after its reply; any other's is in total_s.
        precopy = 0.0 if r["live"] else r["precopy_s"]
        assert r["total_s"] == pytest.approx(precopy + r["offload_s"] + r["migrate_s"] + r["onload_s"], abs=1e-5)
    assert all(r["requests"] == 4 for r in rows if r["loaded"])
    for r in rows:
        if r["migrated"]:  # the migrated streams were told apart (by request id) and measured
            assert r["migrated_added_gaps"] is not None and r["hop_added_gaps"] is not None, r
            if r["hop_ms"] is not None:  # a moved stream that went on through its takeover
                assert all(r["hop_ms"][k] > 0 for k in HOP_PARTS[:3]), r
            if r["hop_net_gaps"] is not None:
                assert r["hop_net_gaps"] <= r["hop_added_gaps"] + 1e-9, r
            assert r["handover_s"] is not None and r["handover_s"] >= r["offload_s"] + r["migrate_s"] - 1e-5, r
