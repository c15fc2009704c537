"""Exact timings in `bench serve --json`: the per-process timing ring (triptych/timings.py),
the router's wait clock (router/overhead.py), their percentiles, and one real 1E1P1D run
whose report carries exact, non-null migration times and router overhead per topology."""

from __future__ import annotations

import json

import pytest

from triptych.bench.exact_timings import timing_figures
from triptych.bench.serve import cli_main
from triptych.cli import build_parser
from triptych.router.overhead import WaitClock, record_first_token
from triptych.timings import TimingRecord, TimingRing

# --- the ring ----------------------------------------------------------------------------------


def test_ring_pages_what_came_after_a_mark() -> None:
    ring = TimingRing(capacity=4)
    mark = ring.page(1 << 62).next
    assert mark == 0
    ring.record("pd", 0.002, {"read": 0.001}, nbytes=4096)
    ring.record("ep", 0.001)
    page = ring.page(mark)
    assert [(r.seq, r.kind, r.seconds, r.nbytes) for r in page.records] == [(0, "pd", 0.002, 4096), (1, "ep", 0.001, 0)]
    assert page.records[0].phases == {"read": 0.001} and page.next == 2 and not page.dropped
    assert ring.page(page.next).records == []


def test_ring_says_when_records_fell_off() -> None:
    ring = TimingRing(capacity=2)
    for i in range(5):
        ring.record("pd", float(i))
    page = ring.page(0)
    assert page.dropped and [r.seconds for r in page.records] == [3.0, 4.0]
    assert not ring.page(3).dropped


# --- the router's wait clock -------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_waits_count_once() -> None:
    t = FakeClock()
    clock = WaitClock(t)
    t.now += 0.001  # planning: the router's own
    clock.begin()  # two encode-only runs at once
    t.now += 0.002
    clock.begin()
    t.now += 0.003
    clock.end()
    t.now += 0.001
    clock.end()  # waited 0.006 in all, not 0.009
    t.now += 0.0005
    elapsed, own = clock.overhead()
    assert elapsed == pytest.approx(0.0075) and own == pytest.approx(0.0015)
    with pytest.raises(RuntimeError):
        clock.end()


def test_first_token_records_the_overhead() -> None:
    t, ring = FakeClock(), TimingRing()
    clock = WaitClock(t)
    clock.begin()
    t.now += 0.010
    clock.end()
    t.now += 0.0002
    assert record_first_token(clock, ring) == pytest.approx(0.0002)
    (rec,) = ring.page(0).records
    assert rec.kind == "request" and rec.phases["waited"] == pytest.approx(0.010)


# --- percentiles -------------------------------------------------------------------------------


def test_figures_are_exact_percentiles() -> None:
    recs = [TimingRecord(seq=i, kind="pd", seconds=s, phases={"read": s / 2}) for i, s in
            enumerate([0.001, 0.002, 0.003, 0.004, 0.100])]
    recs += [TimingRecord(seq=9, kind="request", seconds=0.0004), TimingRecord(seq=10, kind="request", seconds=0.0006)]
    fig = timing_figures(recs)
    assert fig["timings_source"] == "exact"
    assert fig["pd_migrations"] == 5 and fig["pd_migration_p50_s"] == 0.003
    assert fig["pd_migration_p95_s"] == pytest.approx(0.004 + 0.8 * 0.096)  # numpy's linear rule, no buckets
    assert fig["pd_migration_phases_p50_s"] == {"read": 0.0015}
    assert fig["pd_migration_phases_p95_s"]["read"] == pytest.approx(fig["pd_migration_p95_s"] / 2)
    assert fig["ep_migrations"] == 0 and fig["ep_migration_p95_s"] is None
    assert fig["router_overhead_requests"] == 2 and fig["router_overhead_p50_s"] == pytest.approx(0.0005)


# --- a real run --------------------------------------------------------------------------------

REQUIRED = ("ttft_p50_s", "ep_migration_p95_s", "pd_migration_p95_s", "router_overhead_p50_s", "idle_cpu_cores")


@pytest.mark.slow
def test_bench_serve_json_has_exact_figures_per_topology(capsys: pytest.CaptureFixture[str]) -> None:
    n = 3
    args = build_parser().parse_args(
        ["bench", "serve", "--topologies", "1E1P1D", "--model", "tiny", "--rates", "2", "--num-requests", str(n),
         "--output-len", "4", "--idle-seconds", "0.5", "--json"])
    assert cli_main(args) == 0
    rep = json.loads(capsys.readouterr().out)["topologies"]["1E1P1D"]
    assert rep["completed"] == n
    for key in REQUIRED:
        assert isinstance(rep[key], float), (key, rep[key])
    assert rep["timings_source"] == "exact"
    # One E->P pull (one image) and one P->D pull per measured request; the warm-up's are not counted.
    assert rep["ep_migrations"] == n and rep["pd_migrations"] == n and rep["router_overhead_requests"] == n
    for kind in ("ep", "pd"):
        assert 0 < rep[f"{kind}_migration_p50_s"] <= rep[f"{kind}_migration_p95_s"]
        phases = rep[f"{kind}_migration_phases_p50_s"]
        assert {"dispatch", "prepare", "read", "confirm"} <= set(phases)
    assert rep["router_overhead_p50_s"] < rep["ttft_p50_s"]
    # Persistent router->worker connections: 3 requests x 3 hops, at most one new connection per worker.
    assert rep["router_hops"] == 3 * n
    assert rep["router_worker_connections_opened"] < rep["router_hops"]
