"""`triptych bench serve`: the pure parts (percentiles, HydraInfer §2.3 SLO semantics,
goodput, sweep plan, histogram quantiles, Poisson arrivals, workload) and the stream
client against the real router HTTP layer over a scripted backend."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from PIL import Image
from routerkit import ScriptedBackend, reply_events

from triptych.bench.client import send_request
from triptych.bench.errors import BenchError
from triptych.bench.nixl_bandwidth import stdout_to_stderr
from triptych.bench.prom_text import (
    histogram_buckets,
    histogram_quantile,
    metric_deltas,
    migration_figures,
    parse_metrics,
)
from triptych.bench.report import plot_attainment
from triptych.bench.stats import (
    RequestResult,
    goodput,
    meets_slo,
    next_sweep_rate,
    percentile,
    slo_attainment,
    timeline_result,
)
from triptych.bench.workload import Workload, build_bodies, make_image_data_url, poisson_arrivals
from triptych.local import free_port
from triptych.processor import MultimodalProcessor
from triptych.router.api import create_app
from triptych.router.config import RouterConfig

# --- percentiles -----------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(BenchError):
        percentile(xs, 101)


# --- timelines and SLO semantics ---------------------------------------------------------------


def test_timeline_expands_multi_token_chunks_into_zero_gaps() -> None:
    # Role-less chunks: (t, tokens, has_text). The 2nd chunk delivers 3 tokens at once.
    r = timeline_result([(0.5, 1, True), (0.7, 3, True), (1.0, 1, True)], end=1.1, num_tokens=5)
    assert r.ok and r.ttft == 0.5 and r.e2e == 1.1 and r.num_tokens == 5
    assert r.gaps == pytest.approx([0.2, 0.0, 0.0, 0.3])
    assert r.tpot == pytest.approx((1.1 - 0.5) / 4)


def test_timeline_ttft_is_first_text_and_empty_stream_fails() -> None:
    # A token that decodes to no text (held back) still counts for the gaps.
    r = timeline_result([(0.2, 1, False), (0.3, 1, True)], end=0.3)
    assert r.ttft == 0.3 and r.num_tokens == 2 and r.gaps == pytest.approx([0.1])
    assert not timeline_result([], end=1.0).ok
    assert RequestResult(ttft=0.1, e2e=0.1, num_tokens=1).tpot is None


def _req(ttft: float, gaps: list[float]) -> RequestResult:
    return RequestResult(ttft=ttft, e2e=ttft + sum(gaps), gaps=gaps, num_tokens=len(gaps) + 1)


def test_slo_needs_ttft_and_ninety_percent_of_gaps() -> None:
    good_gaps = [0.1] * 9 + [5.0]  # exactly 90% within the TBT SLO
    assert meets_slo(_req(1.0, good_gaps), ttft_slo=1.0, tbt_slo=0.2)  # TTFT == SLO is met
    assert not meets_slo(_req(1.01, good_gaps), ttft_slo=1.0, tbt_slo=0.2)
    bad_gaps = [0.1] * 8 + [5.0, 5.0]  # 80%
    assert not meets_slo(_req(0.1, bad_gaps), ttft_slo=1.0, tbt_slo=0.2)
    assert meets_slo(_req(0.1, [0.2]), ttft_slo=1.0, tbt_slo=0.2)  # a gap == SLO is within
    assert meets_slo(_req(0.1, []), ttft_slo=1.0, tbt_slo=0.2)  # one token: TTFT only
    assert not meets_slo(RequestResult(error="HTTP 503"), ttft_slo=1.0, tbt_slo=0.2)


def test_attainment_counts_failed_requests_in_the_denominator() -> None:
    results = [_req(0.1, [0.1]), _req(0.1, [0.1]), _req(3.0, [0.1]), RequestResult(error="timeout")]
    assert slo_attainment(results, ttft_slo=1.0, tbt_slo=0.2) == 0.5
    assert slo_attainment([], 1.0, 0.2) is None


# --- goodput and the sweep ---------------------------------------------------------------------


def test_goodput_is_highest_rate_meeting_the_target() -> None:
    assert goodput([(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5)]) == 4
    assert goodput([(1, 0.89), (2, 0.5)]) is None
    assert goodput([(2, 0.95), (1, 1.0), (4, None)]) == 2
    assert goodput([(1, 0.8)], target=0.75) == 1


def test_sweep_doubles_then_bisects() -> None:
    def plan(points: list[tuple[float, float]]) -> float | None:
        return next_sweep_rate(points, start=1.0, max_rate=100, refine_steps=2)

    capacity = 5.0  # attainment holds up to this rate
    points: list[tuple[float, float]] = []
    while (rate := plan(points)) is not None:
        points.append((rate, 1.0 if rate <= capacity else 0.2))
    assert [r for r, _ in points] == [1, 2, 4, 8, 6, 5]
    assert goodput(points) == 5


def test_sweep_stops_at_max_rate_and_bisects_down_from_a_failing_start() -> None:
    pts: list[tuple[float, float]] = [(1, 1.0), (2, 1.0), (4, 1.0)]
    assert next_sweep_rate(pts, start=1, max_rate=4, refine_steps=2) is None
    assert next_sweep_rate([(1, 0.0)], start=1, max_rate=8, refine_steps=2) == 0.5
    assert next_sweep_rate([(1, 0.0), (0.5, 0.0), (0.25, 1.0)], start=1, max_rate=8, refine_steps=2) is None


# --- Prometheus histograms ---------------------------------------------------------------------

BEFORE = """\
# TYPE triptych_worker_migration_seconds histogram
triptych_worker_migration_seconds_bucket{kind="ep",transport="nixl",le="0.01"} 2
triptych_worker_migration_seconds_bucket{kind="ep",transport="nixl",le="0.1"} 2
triptych_worker_migration_seconds_bucket{kind="ep",transport="nixl",le="+Inf"} 2
triptych_worker_migration_seconds_count{kind="ep",transport="nixl"} 2
triptych_worker_migration_seconds_sum{kind="ep",transport="nixl"} 0.01
# TYPE triptych_worker_transfer_bytes_total counter
triptych_worker_transfer_bytes_total{transport="nixl",direction="pull",region="mm"} 1000
"""
AFTER = """\
# TYPE triptych_worker_migration_seconds histogram
triptych_worker_migration_seconds_bucket{kind="ep",transport="nixl",le="0.01"} 6
triptych_worker_migration_seconds_bucket{kind="ep",transport="nixl",le="0.1"} 12
triptych_worker_migration_seconds_bucket{kind="ep",transport="nixl",le="+Inf"} 12
triptych_worker_migration_seconds_count{kind="ep",transport="nixl"} 12
triptych_worker_migration_seconds_sum{kind="ep",transport="nixl"} 0.3
triptych_worker_migration_seconds_bucket{kind="pd",transport="tcp",le="0.01"} 0
triptych_worker_migration_seconds_bucket{kind="pd",transport="tcp",le="0.1"} 1
triptych_worker_migration_seconds_bucket{kind="pd",transport="tcp",le="+Inf"} 2
triptych_worker_migration_seconds_count{kind="pd",transport="tcp"} 2
triptych_worker_migration_seconds_sum{kind="pd",transport="tcp"} 9
# TYPE triptych_worker_transfer_bytes_total counter
triptych_worker_transfer_bytes_total{transport="nixl",direction="pull",region="mm"} 5096
triptych_worker_transfer_bytes_total{transport="tcp",direction="pull",region="kv"} 2048
"""


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    buckets = [(0.01, 4.0), (0.1, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.005)  # rank 2 of 4 in [0, 0.01]
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.01 + 0.09 * 3 / 6)
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.1)
    # A rank in the +Inf bucket gives the highest finite bound, as Prometheus does.
    assert histogram_quantile(0.99, [(0.1, 1.0), (math.inf, 2.0)]) == 0.1
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    with pytest.raises(BenchError):
        histogram_quantile(0.5, [(0.1, 1.0)])


def test_migration_figures_come_from_bucket_deltas() -> None:
    deltas = metric_deltas(parse_metrics(BEFORE), parse_metrics(AFTER))
    ep = histogram_buckets(deltas, "triptych_worker_migration_seconds", kind="ep")
    assert ep == [(0.01, 4.0), (0.1, 10.0), (math.inf, 10.0)]  # the 2 earlier ones are gone
    fig = migration_figures(deltas)
    assert fig["ep_migrations"] == 10 and fig["pd_migrations"] == 2
    assert fig["ep_migration_p50_s"] == pytest.approx(0.01 + 0.09 * 1 / 6)
    assert fig["pd_migration_p50_s"] == pytest.approx(0.1)  # rank 1 of 2: top of (0.01, 0.1]
    assert fig["pd_migration_p95_s"] == pytest.approx(0.1)  # in +Inf: highest finite bound
    assert fig["migration_transports"] == ["nixl", "tcp"]
    assert fig["transfer_bytes"] == {"transport=nixl,region=mm": 4096, "transport=tcp,region=kv": 2048}
    assert fig["transfer_bytes_total"] == 6144


def test_a_counter_reset_counts_from_zero() -> None:
    before = [("c_total", (), 100.0)]
    assert metric_deltas(before, [("c_total", (), 30.0)]) == [("c_total", (), 30.0)]


# --- arrivals and workload -----------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_have_the_right_rate() -> None:
    a = poisson_arrivals(4.0, 2000, seed=1)
    assert a == poisson_arrivals(4.0, 2000, seed=1)
    assert a != poisson_arrivals(4.0, 2000, seed=2)
    assert a[0] == 0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.1)
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(BenchError):
        poisson_arrivals(0.0, 3, seed=0)


def test_bodies_are_seeded_multimodal_streaming_requests() -> None:
    work = Workload(num_requests=3, images_per_request=2, image_size=(40, 24), prompt_len=5, output_len=7)
    bodies = build_bodies(work, "m", seed=3)
    assert bodies == build_bodies(work, "m", seed=3) and bodies != build_bodies(work, "m", seed=4)
    body = json.loads(bodies[0])
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert len(parts[2]["text"].split()) == 5
    urls = {json.loads(b)["messages"][0]["content"][i]["image_url"]["url"] for b in bodies for i in (0, 1)}
    assert len(urls) == 6  # every image unique: no embedding-cache hits


def test_image_data_url_is_a_png_of_the_requested_size() -> None:
    import base64
    import io

    url = make_image_data_url(random.Random(0), 33, 17)
    assert url.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert img.format == "PNG" and img.size == (33, 17)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "a" / "att.png"
    plot_attainment({"1E1P1D": [(1.0, 1.0), (2.0, 0.5)], "EPD": [(1.0, 0.8)]}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nixl_logs_cannot_pollute_json_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    with stdout_to_stderr():
        os.write(1, b"native log line\n")
        subprocess.run([sys.executable, "-c", "print('child log line')"], timeout=60, check=True)
    os.write(1, b"{}\n")
    out, err = capfd.readouterr()
    assert out == "{}\n"
    assert "native log line" in err and "child log line" in err


def test_the_module_imports_no_torch() -> None:
    code = "import sys, triptych.bench.serve, triptych.bench.idle_cpu; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# --- the stream client against the real router HTTP layer ---------------------------------------


@pytest.fixture
async def router_url(processor: MultimodalProcessor, backend: ScriptedBackend,
                     config: RouterConfig) -> AsyncIterator[str]:
    """The router app served by uvicorn on a loopback port (httpx's ASGI transport would
    buffer the stream and hide the token timing), on this test's event loop."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config, backend, processor=processor),
                                           host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_send_request_times_a_real_router_stream(
        processor: MultimodalProcessor, backend: ScriptedBackend, router_url: str) -> None:
    backend.delay_s = 0.05
    backend.script = lambda req: reply_events(processor, per_event=2, eos=False)
    n_tokens = len(processor.encode("Hello there, world!"))
    body = build_bodies(Workload(num_requests=1, output_len=64), "tiny-qwen", seed=0)[0]
    async with httpx.AsyncClient(trust_env=False) as client:
        r = await send_request(client, f"{router_url}/v1/chat/completions", body, timeout_s=10)
    assert r.ok, r.error
    assert r.num_tokens == n_tokens
    assert len(r.gaps) == n_tokens - 1
    assert r.ttft >= 0.05 and r.e2e >= r.ttft
    # Two tokens per event: every other gap is the backend's delay, the rest zero.
    assert sum(g >= 0.04 for g in r.gaps) == (n_tokens - 1) // 2
    assert sum(g < 0.01 for g in r.gaps) == n_tokens // 2
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / (n_tokens - 1))


async def test_send_request_reports_http_errors_and_timeouts(
        backend: ScriptedBackend, router_url: str) -> None:
    url = f"{router_url}/v1/chat/completions"
    bad = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True})
    async with httpx.AsyncClient(trust_env=False) as client:
        r = await send_request(client, url, bad.encode(), timeout_s=10)
        assert not r.ok and r.error.startswith("HTTP 404")
        backend.delay_s = 2.0
        body = build_bodies(Workload(num_requests=1, images_per_request=0), "tiny-qwen", seed=0)[0]
        r = await send_request(client, url, body, timeout_s=0.3)
        assert not r.ok and r.error.startswith("timeout")
