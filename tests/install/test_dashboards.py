"""The Grafana dashboards: generated JSON in sync (deploy/ and the chart), and every panel's
PromQL run against a real Prometheus (Debian's `prometheus`) scraping a local 1E1P1D
deployment under load: each query must parse and return data."""

from __future__ import annotations

import base64
import io
import json
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image
from polling import wait_until

from triptych import dashboards
from triptych.cli_args import resolve_model
from triptych.http_ready import answers_ok
from triptych.local import LocalDeployment, free_port
from triptych.topology import parse_topology

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = ROOT / "deploy" / "dashboards"
CHART_DIR = ROOT / "charts" / "triptych" / "dashboards"
WINDOW = "20s"  # $window in the test; the scrape interval is 1 s
SUBSTITUTE = {"$namespace": ".*", "$model": ".*", "$window": WINDOW}


def concrete(expr: str) -> str:
    for var, value in SUBSTITUTE.items():
        expr = expr.replace(var, value)
    return expr


@pytest.mark.parametrize("where", [DEPLOY_DIR, CHART_DIR], ids=["deploy", "chart"])
def test_checked_in_dashboards_are_generated(where: Path) -> None:
    rendered = dashboards.render_all()
    assert sorted(p.name for p in where.glob("*.json")) == sorted(rendered), \
        "run: triptych dashboards --out deploy/dashboards && triptych dashboards --out charts/triptych/dashboards"
    for name, text in rendered.items():
        assert (where / name).read_text() == text, f"{where / name} is stale: regenerate it"


def test_cli_writes_the_dashboards(tmp_path: Path) -> None:
    from triptych.cli import main

    assert main(["dashboards", "--out", str(tmp_path)]) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == dashboards.render_all()


def test_dashboard_shape() -> None:
    for dash in dashboards.DASHBOARDS:
        doc = dashboards.render(dash)
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids))
        for panel in doc["panels"]:
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
            if panel["type"] == "row":
                continue
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert "$" not in concrete(target["expr"]), target["expr"]
    titles = [p.title for d in dashboards.DASHBOARDS for p in d.panels]
    assert len(titles) == len(set(titles))
    # The panels, by what they show.
    exprs = " ".join(q.expr for d in dashboards.DASHBOARDS for p in d.panels for q in p.queries)
    for needle in ("triptych_frontend_slo_requests_total", "triptych_frontend_time_to_first_token_seconds_bucket",
                   "triptych_frontend_time_between_tokens_seconds_bucket", 'kind="ep"', 'kind="pd"',
                   "triptych_worker_cache_blocks", 'transport!~"nixl-.*"', "triptych_planner_"):
        assert needle in exprs, needle
    exempt = [p.title for d in dashboards.DASHBOARDS for p in d.panels if p.no_data_reason]
    assert exempt == ["Planner decisions"]


# --- a real Prometheus against a loaded deployment --------------------------------------------

def _png(seed: int) -> str:
    rng = random.Random(seed)
    img = Image.new("RGB", (56, 56), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _load(router: str, model: str, stop: threading.Event, errors: list[str]) -> None:
    """Requests with fresh images (so every request encodes) until stopped."""
    seed = 0
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            seed += 1
            body = {"model": model, "max_tokens": 6, "temperature": 0, "stream": seed % 2 == 0,
                    "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": _png(seed)}},
                        {"type": "text", "text": f"Describe picture {seed}."}]}]}
            try:
                r = client.post(f"{router}/v1/chat/completions", json=body)
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                errors.append(repr(e))


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs Debian's prometheus package (tools/install-test-deps.sh installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    topology = parse_topology("1E1P1D")
    with LocalDeployment(model=resolve_model("tiny"), topology=topology, transfer_require="nixl",
                         router_args=["--ttft-slo", "5", "--tbt-slo", "1"], log_dir=tmp / "logs") as dep:
        targets = [p.url.removeprefix("http://") for p in dep.processes]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "triptych", "static_configs": [{"targets": targets}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=open(tmp / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{dep.router_url}/v1/models", timeout=10).json()["data"][0]["id"]
        stop, errors = threading.Event(), []
        threads = [threading.Thread(target=_load, args=(dep.router_url, model, stop, errors)) for _ in range(2)]
        try:
            if not wait_until(lambda: answers_ok(f"{url}/-/ready"), 30, interval_s=0.5):
                raise AssertionError(f"prometheus not ready: {(tmp / 'prometheus.log').read_text()[-2000:]}")
            for t in threads:
                t.start()
            yield url
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=90)
            proc.terminate()
            proc.wait(timeout=30)
        assert not errors, errors[:3]


def _query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def _wait_query(url: str, expr: str, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not (result := _query(url, expr)) and time.monotonic() < deadline:
        time.sleep(1)
    return result


def _panels() -> list[dashboards.Panel]:
    return [p for d in dashboards.DASHBOARDS for p in d.panels]


def test_every_panel_query_returns_data(prometheus_url: str) -> None:
    """One test for all panels (they share the deployment and its warm-up); a missing series is
    retried until the deadline, since histograms need a few scrapes under load."""
    pending = {(p.title, q.expr) for p in _panels() for q in p.queries}
    exempt = {p.title: p.no_data_reason for p in _panels() if p.no_data_reason}
    deadline = time.monotonic() + 120
    while True:
        for title, expr in sorted(pending):
            result = _query(prometheus_url, concrete(expr))  # parses: status success
            if result or title in exempt:
                pending.discard((title, expr))
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not pending, f"no data after 120 s under load: {sorted(pending)}"


def test_fallback_panel_is_zero_on_nixl(prometheus_url: str) -> None:
    """The deployment runs with --transfer-require nixl: the loud fallback stat reads 0, and the
    bandwidth panel shows nixl-* transports only."""
    transports = {s["metric"]["transport"] for s in _wait_query(
        prometheus_url, "sum by (transport) (triptych_worker_transfer_bytes_total)")}
    assert transports and all(t.startswith("nixl-") for t in transports), transports
    fallback = _query(prometheus_url, concrete(dashboards.FALLBACK_BYTES_EXPR))
    assert [float(s["value"][1]) for s in fallback] == [0.0]


def test_variable_queries_return_values(prometheus_url: str) -> None:
    variables = dashboards.render(dashboards.SLO)["templating"]["list"]
    model_var = next(v for v in variables if v["name"] == "model")
    metric = model_var["definition"].removeprefix("label_values(").split(",")[0]
    assert _wait_query(prometheus_url, metric)
    r = httpx.get(f"{prometheus_url}/api/v1/label/model/values", params={"match[]": metric}, timeout=10)
    assert r.json()["data"], r.text


def test_dashboard_json_is_valid_json() -> None:
    for text in dashboards.render_all().values():
        assert json.loads(text)["schemaVersion"] >= 36
