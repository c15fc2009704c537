"""Snapshot builders over recorded metrics: the router's real FrontendMetrics exposition,
worker queue gauges as worker/server.py writes them, and Prometheus API responses."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from triptych.operator.planner.signals import (
    PrometheusClient,
    Scraper,
    parse_metrics,
    promql,
    snapshot_from_prometheus,
    snapshot_from_scrapes,
)
from triptych.router.metrics import FrontendMetrics, RequestTimer

WORKERS = """\
# HELP triptych_worker_requests Requests on this instance by state
# TYPE triptych_worker_requests gauge
triptych_worker_requests{instance="e0",role="E",state="waiting"} 6.0
triptych_worker_requests{instance="e0",role="E",state="running"} 2.0
triptych_worker_requests{instance="ep0",role="EP",state="waiting"} 4.0
triptych_worker_requests{instance="d0",role="D",state="waiting"} 3.0
triptych_worker_requests{instance="d1",role="D",state="waiting"} 1.0
"""
ROUTER_INSTANCES = """\
# HELP triptych_frontend_instance_load Queued work each instance reported at its last health probe
# TYPE triptych_frontend_instance_load gauge
triptych_frontend_instance_load{instance="http://e0",role="E"} 9.0
triptych_frontend_instance_load{instance="http://ep0",role="EP"} 700.0
triptych_frontend_instance_load{instance="http://d0",role="D"} 3.0
# HELP triptych_frontend_instance_ready 1 when routable
# TYPE triptych_frontend_instance_ready gauge
triptych_frontend_instance_ready{instance="http://e0",role="E"} 1.0
triptych_frontend_instance_ready{instance="http://ep0",role="EP"} 1.0
triptych_frontend_instance_ready{instance="http://d0",role="D"} 1.0
triptych_frontend_instance_ready{instance="http://d1",role="D"} 0.0
"""


def finish(m: FrontendMetrics, ttft: float, gaps: list[float]) -> None:
    t = RequestTimer(start=0.0)
    t.tokens(1, now=ttft)
    now = ttft
    for g in gaps:
        now += g
        m.observe_gaps(t.tokens(1, now=now))  # as router/streaming.py: each gap as it arrives
    m.record_completion(t)


def test_snapshot_from_two_scrapes_of_real_router_metrics() -> None:
    m = FrontendMetrics("m", ttft_slo_s=1.0, tbt_slo_s=0.1, registry=CollectorRegistry())
    finish(m, 0.3, [0.05] * 4)  # before the first scrape: not in the window
    before = generate_latest(m.registry).decode()
    for _ in range(10):
        finish(m, 0.3, [0.05] * 4)  # met
    for _ in range(10):
        finish(m, 4.0, [0.05] * 4)  # missed: TTFT over 1 s
    m.prompt_tokens.labels("m").inc(20 * 50)
    m.generation_tokens.labels("m").inc(20 * 5)
    m.images.labels("m").inc(30)
    after = generate_latest(m.registry).decode()
    prev = parse_metrics([before, WORKERS, ROUTER_INSTANCES])
    cur = parse_metrics([after, WORKERS, ROUTER_INSTANCES])
    s = snapshot_from_scrapes(prev, cur, dt_s=10.0, now=123.0)
    assert s.at == 123.0 and s.source == "scrape"
    assert s.arrival_rate_rps == pytest.approx(2.0)
    assert s.slo_attainment == pytest.approx(0.5)
    assert s.images_per_request == pytest.approx(1.5)
    assert s.prompt_tokens_per_request == pytest.approx(50)
    assert s.output_tokens_per_request == pytest.approx(5)
    # p90 of 10 x 0.3 s and 10 x 4.0 s: rank 18 falls in the (3, 5] bucket, 8 of its 10 in
    assert s.ttft_p90_s == pytest.approx(3.0 + 2.0 * 8 / 10)
    assert s.tbt_p90_s == pytest.approx(0.04 + 0.02 * 0.9)  # all 80 gaps in (0.04, 0.06]: linear inside
    # queues: waiting requests split over the role's stages; load as tokens (P-capable) or images (E)
    q = s.queues
    assert (q["encode"].requests, q["prefill"].requests, q["decode"].requests) == (8.0, 2.0, 4.0)
    assert (q["encode"].images, q["prefill"].tokens) == (9.0, 700.0)
    assert (q["encode"].instances, q["prefill"].instances, q["decode"].instances) == (2, 1, 1)
    assert s.instances == {"E": 1, "EP": 1, "D": 1}


def test_first_scrape_has_gauges_only() -> None:
    m = FrontendMetrics("m", ttft_slo_s=1.0, tbt_slo_s=0.1, registry=CollectorRegistry())
    finish(m, 5.0, [])
    s = snapshot_from_scrapes(None, parse_metrics([generate_latest(m.registry).decode(), WORKERS]), None, now=1.0)
    assert s.slo_attainment == 0.0  # the window gauge
    assert s.arrival_rate_rps is None and s.ttft_p90_s is None
    assert s.queues["decode"].requests == 4.0


def test_per_stage_worker_queues_win_over_estimates() -> None:
    text = WORKERS + """\
# TYPE triptych_worker_queued_tokens gauge
triptych_worker_queued_tokens{instance="ep0",role="EP",stage="prefill"} 1234.0
# TYPE triptych_worker_queued_requests gauge
triptych_worker_queued_requests{instance="ep0",role="EP",stage="encode"} 1.0
"""
    s = snapshot_from_scrapes(None, parse_metrics([text, ROUTER_INSTANCES]), None, now=1.0)
    assert s.queues["prefill"].tokens == 1234.0 and s.queues["encode"].requests == 1.0


def test_scraper_reads_components_over_http() -> None:
    texts = {"http://w:1": WORKERS, "http://r:2": ROUTER_INSTANCES}

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=texts[f"{req.url.scheme}://{req.url.host}:{req.url.port}"])

    scraper = Scraper(list(texts), transport=httpx.MockTransport(handler))
    first, second = scraper.snapshot(), scraper.snapshot()
    assert first.queues["decode"].requests == second.queues["decode"].requests == 4.0
    assert second.arrival_rate_rps == 0.0  # no finished requests between the scrapes


# --- Prometheus HTTP API -------------------------------------------------------------------
def vector(*rows: tuple[dict[str, str], float]) -> dict:
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": m, "value": [1700000000.0, str(v)]} for m, v in rows]}}


RECORDED = {
    "waiting": vector(({"role": "E"}, 6), ({"role": "PD"}, 4)),
    "load": vector(({"role": "E"}, 12), ({"role": "PD"}, 900)),
    "ready": vector(({"instance": "a", "role": "E"}, 1), ({"instance": "b", "role": "PD"}, 1),
                    ({"instance": "c", "role": "PD"}, 1)),
    "queued_requests": vector(), "queued_tokens": vector(), "queued_images": vector(),
    "ttft_p90": vector(({}, 0.8)), "tbt_p90": vector(({}, 0.04)),
    "slo_met": vector(({}, 1.5)), "slo_all": vector(({}, 2.0)), "slo_gauge": vector(({}, 0.7)),
    "finished": vector(({}, 2.0)), "images": vector(({}, 4.0)), "prompt": vector(({}, 200.0)),
    "output": vector(({}, 60.0)), "tpot_p90": vector(), "running": vector(), "seats": vector(),
    "kv_used": vector(), "kv_free": vector(), "video_gop_sets": vector(),
}


def prometheus(recorded: dict[str, dict]) -> PrometheusClient:
    by_query = {q: recorded[k] for k, q in promql("2m").items()}

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/api/v1/query"
        return httpx.Response(200, text=json.dumps(by_query[req.url.params["query"]]))

    return PrometheusClient("http://prom:9090", transport=httpx.MockTransport(handler))


def test_snapshot_from_prometheus_responses() -> None:
    client = prometheus(RECORDED)
    s = snapshot_from_prometheus(client.query, "2m", now=5.0)
    assert s.source == "prometheus" and s.at == 5.0
    assert (s.ttft_p90_s, s.tbt_p90_s, s.slo_attainment) == (0.8, 0.04, 0.75)
    assert (s.arrival_rate_rps, s.images_per_request, s.prompt_tokens_per_request,
            s.output_tokens_per_request) == (2.0, 2.0, 100.0, 30.0)
    assert s.queues["encode"].requests == 6 and s.queues["prefill"].requests == 2 == s.queues["decode"].requests
    assert s.queues["prefill"].tokens == 900 and s.queues["encode"].images == 12
    assert s.instances == {"E": 1, "PD": 2}


def test_idle_deployment_falls_back_to_the_attainment_gauge() -> None:
    rec = dict(RECORDED, slo_all=vector(({}, 0.0)), slo_met=vector(({}, 0.0)), ttft_p90=vector(({}, float("nan"))))
    s = snapshot_from_prometheus(prometheus(rec).query, "2m", now=5.0)
    assert s.slo_attainment == 0.7 and s.ttft_p90_s is None


def test_prometheus_error_is_raised() -> None:
    client = PrometheusClient("http://prom:9090", transport=httpx.MockTransport(
        lambda req: httpx.Response(200, json={"status": "error", "error": "parse error"})))
    with pytest.raises(RuntimeError, match="parse error"):
        client.query("up{")


def test_prometheus_per_stage_worker_queues_win_over_estimates() -> None:
    rec = dict(RECORDED, queued_requests=vector(({"stage": "encode"}, 3), ({"stage": "prefill"}, 1),
                                                ({"stage": "decode"}, 0)),
               queued_tokens=vector(({"stage": "prefill"}, 4321)),
               queued_images=vector(({"stage": "encode"}, 7)))
    s = snapshot_from_prometheus(prometheus(rec).query, "2m", now=5.0)
    q = s.queues
    assert (q["encode"].requests, q["prefill"].requests, q["decode"].requests) == (3, 1, 0)
    assert (q["prefill"].tokens, q["encode"].images) == (4321, 7)


# --- decode pressure and video decode queues --------------------------------------------------
DECODE_WORKERS = """\
# HELP triptych_worker_requests Requests on this instance by state
# TYPE triptych_worker_requests gauge
triptych_worker_requests{instance="p0",role="P",state="running"} 3.0
triptych_worker_requests{instance="d0",role="D",state="running"} 7.0
triptych_worker_requests{instance="pd0",role="PD",state="running"} 5.0
# HELP triptych_worker_max_num_seqs Requests this instance runs at most at once
# TYPE triptych_worker_max_num_seqs gauge
triptych_worker_max_num_seqs{instance="p0",role="P"} 8.0
triptych_worker_max_num_seqs{instance="d0",role="D"} 8.0
triptych_worker_max_num_seqs{instance="pd0",role="PD"} 12.0
# HELP triptych_worker_cache_blocks Cache blocks by cache and state
# TYPE triptych_worker_cache_blocks gauge
triptych_worker_cache_blocks{cache="kv",instance="p0",role="P",state="used"} 90.0
triptych_worker_cache_blocks{cache="kv",instance="p0",role="P",state="free"} 10.0
triptych_worker_cache_blocks{cache="kv",instance="d0",role="D",state="used"} 30.0
triptych_worker_cache_blocks{cache="kv",instance="d0",role="D",state="free"} 70.0
triptych_worker_cache_blocks{cache="kv",instance="pd0",role="PD",state="used"} 50.0
triptych_worker_cache_blocks{cache="kv",instance="pd0",role="PD",state="free"} 50.0
triptych_worker_cache_blocks{cache="mm",instance="pd0",role="PD",state="used"} 999.0
"""


def test_scraped_decode_pressure_counts_the_decoding_roles_only() -> None:
    m = FrontendMetrics("m", ttft_slo_s=1.0, tbt_slo_s=0.1, registry=CollectorRegistry())
    video = "# TYPE triptych_frontend_video_queued_gop_sets gauge\ntriptych_frontend_video_queued_gop_sets 6.0\n"
    before = parse_metrics([generate_latest(m.registry).decode(), DECODE_WORKERS, video])
    for _ in range(10):
        finish(m, 0.2, [0.3] * 3)  # TPOT 0.3 s for every request
    after = parse_metrics([generate_latest(m.registry).decode(), DECODE_WORKERS, video])
    s = snapshot_from_scrapes(before, after, 10.0, now=1.0)
    # D and PD decode, P does not: 12 running of 20 seats, 80 of 200 KV blocks (mm not counted)
    assert (s.decode.running, s.decode.seats, s.decode.kv_used_blocks, s.decode.kv_total_blocks) == (12, 20, 80, 200)
    assert s.decode.occupancy == pytest.approx(0.6) and s.decode.kv_use == pytest.approx(0.4)
    assert s.tpot_p90_s is not None and 0.25 < s.tpot_p90_s <= 0.5  # the bucket holding 0.3
    assert s.video_queued_gop_sets == 6.0


def test_no_decode_signal_without_the_gauges() -> None:
    s = snapshot_from_scrapes(None, parse_metrics([WORKERS]), None, now=1.0)
    assert s.decode.occupancy is None and s.decode.kv_use is None and s.video_queued_gop_sets is None


def test_prometheus_decode_pressure_and_video_queue() -> None:
    rec = dict(RECORDED, tpot_p90=vector(({}, 0.12)),
               running=vector(({"role": "P"}, 3), ({"role": "D"}, 7), ({"role": "PD"}, 5)),
               seats=vector(({"role": "P"}, 8), ({"role": "D"}, 8), ({"role": "PD"}, 12)),
               kv_used=vector(({"role": "P"}, 90), ({"role": "D"}, 30), ({"role": "PD"}, 50)),
               kv_free=vector(({"role": "P"}, 10), ({"role": "D"}, 70), ({"role": "PD"}, 50)),
               video_gop_sets=vector(({}, 9)))
    s = snapshot_from_prometheus(prometheus(rec).query, "2m", now=5.0)
    assert s.tpot_p90_s == 0.12 and s.video_queued_gop_sets == 9
    assert s.decode.occupancy == pytest.approx(12 / 20) and s.decode.kv_use == pytest.approx(80 / 200)
