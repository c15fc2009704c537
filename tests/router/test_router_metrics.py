"""SLO attainment (HydraInfer §2.3) and the token timing behind TTFT/TBT."""

from __future__ import annotations

import pytest

from triptych.router.metrics import FrontendMetrics, RequestTimer, meets_slo


@pytest.mark.parametrize(("ttft", "gaps", "met"), [
    (0.5, [0.1] * 10, True),
    (2.5, [0.1] * 10, False),  # TTFT over the SLO
    (2.0, [], True),  # boundary is inclusive; one token has no gaps
    (0.5, [0.1] * 9 + [5.0], True),  # 90% of gaps within the TBT SLO
    (0.5, [0.1] * 8 + [5.0] * 2, False),  # 80% within: below 90%
])
def test_meets_slo_basic(ttft, gaps, met) -> None:
    assert meets_slo(ttft, gaps, ttft_slo_s=2.0, tbt_slo_s=0.2) is met


def test_meets_slo_ninety_percent_rule() -> None:
    ok = [0.1] * 18 + [1.0] * 2  # exactly 90%
    assert meets_slo(0.1, ok, 2.0, 0.2)
    assert not meets_slo(0.1, ok + [1.0], 2.0, 0.2)  # 18/21 < 90%
    assert meets_slo(0.1, [0.2] * 5, 2.0, 0.2)  # gap == SLO counts as within


def test_timer_gaps_count_tokens_of_one_event_as_arriving_together() -> None:
    t = RequestTimer(start=0.0)
    t.tokens(1, now=1.0)
    t.tokens(3, now=1.5)
    t.tokens(0, now=9.0)  # nothing arrived
    t.tokens(1, now=1.6)
    assert t.first_token_at == 1.0 and t.last_token_at == 1.6 and t.num_tokens == 5
    assert t.gaps == pytest.approx([0.5, 0.0, 0.0, 0.1])


def test_a_request_taken_whole_shares_a_groups_wait_among_its_tokens() -> None:
    # Its worker groups the tokens on purpose (stream=false): TBT is the decode's pace, not
    # one long gap and zeros.
    t = RequestTimer(start=0.0, spread=True)
    assert t.tokens(1, now=1.0) == []  # the first token comes alone: its TTFT
    assert t.tokens(4, now=1.4) == pytest.approx([0.1] * 4)
    assert t.tokens(2, now=1.6) == pytest.approx([0.1, 0.1])
    assert t.num_tokens == 7 and t.last_token_at == 1.6


def test_attainment_gauge_and_counters() -> None:
    m = FrontendMetrics("m", ttft_slo_s=1.0, tbt_slo_s=0.1, window=4)
    for ttft in (0.5, 0.5, 3.0, 0.5, 3.0, 3.0):
        t = RequestTimer(start=0.0)
        t.tokens(1, now=ttft)
        t.tokens(1, now=ttft + 0.05)
        m.record_completion(t)
    assert m.slo_requests.labels("m", "met")._value.get() == 3
    assert m.slo_requests.labels("m", "missed")._value.get() == 3
    assert m.slo_attainment.labels("m")._value.get() == 0.25  # last 4: 3.0, 0.5, 3.0, 3.0
    assert m.tpot.labels("m")._sum.get() == pytest.approx(6 * 0.05)


def test_token_gaps_reach_the_tbt_histogram_as_they_happen() -> None:
    # The planner's decode signal reads TBT over its last interval: a request still
    # decoding must show its gaps before it ends (not one request's duration later).
    m = FrontendMetrics("m", ttft_slo_s=1.0, tbt_slo_s=0.1)
    t = RequestTimer(start=0.0)
    assert t.tokens(1, now=0.2) == []
    m.observe_gaps(t.tokens(2, now=0.5))
    tbt = m.tbt.labels("m")
    assert tbt._sum.get() == pytest.approx(0.3)
    assert sum(b.get() for b in tbt._buckets) == 2  # the gap and the token that came with it
    m.observe_gaps(t.tokens(1, now=0.9))
    m.record_completion(t)  # completion adds no gap twice
    assert sum(b.get() for b in tbt._buckets) == 3 and tbt._sum.get() == pytest.approx(0.7)
