"""Video through V instances (`triptych worker --role V`) over HTTP, real processes: the
router spreads each video's GOP sets over the V instances, the encode instance pulls the
patches over NIXL. Greedy tokens equal transformers `generate` (fp32), streamed and not,
with and without an image, through 1V1E1P1D and 2V1E1P1D; bad videos are a 400 with an
OpenAI error body and the V instances keep serving; V instances import no model code and
the encode instance decodes nothing itself."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import servekit
from servekit import tiny_dir
from videokit import SERVING_CASES, bad_video_body, serving_expected, undecodable_clip

from triptych.local import LocalDeployment

pytestmark = pytest.mark.slow

DEPLOYMENTS = [("qwen2-vl", "1V1E1P1D"), ("qwen2-vl", "2V1E1P1D"), ("qwen2.5-vl", "2V1E1P1D")]


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=["-".join(d) for d in DEPLOYMENTS])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family, topology = request.param
    with servekit.start(tiny_dir(family), topology, tmp_path_factory.mktemp(f"{family}-{topology}")) as dep:
        yield family, topology, dep


def _v_workers(dep: LocalDeployment) -> list:
    return [w for w in dep.workers if w.name.startswith("worker-V-")]


def test_router_health_knows_v_instances(deployment) -> None:
    _family, topology, dep = deployment
    body = httpx.get(f"{dep.router_url}/health", timeout=10).json()
    n = int(topology[0])
    assert body["roles"]["V"] == {"ready": n, "total": n}
    assert body["stages"]["video_decode"] == n and body["status"] == "ok"


def test_video_parity_through_v_instances(deployment) -> None:
    family, _topology, dep = deployment
    model = tiny_dir(family)
    results = asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(model.name) for c in SERVING_CASES]))
    for case, want, got in zip(SERVING_CASES, serving_expected(family), results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case, got)
        assert len(want) > 0 and got["token_ids"] == want, case
    encoder = servekit.worker(dep, "E")
    # Every video came from the V instances as pulled patches; E decoded none itself.
    assert servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="v") >= len(SERVING_CASES)
    assert servekit.metric_sum(encoder.url, "triptych_worker_videos_decoded_total", where="encoder") == 0
    stats = servekit.wait_idle(dep)
    assert stats["worker-E-0"]["transfer_bytes"].get("nixl-ucx", 0) > 0  # patches pulled over NIXL
    for w in _v_workers(dep):  # one video's GOP sets spread over every V instance
        assert stats[w.name]["segments"] > 0, (w.name, stats[w.name])
    servekit.assert_no_leaks(stats)


def test_bad_videos_are_400_and_v_keeps_serving(deployment) -> None:
    family, _topology, dep = deployment
    model = tiny_dir(family)
    good = SERVING_CASES[0].video
    refused_at_router = [good[: len(good) // 2], b"not a video at all " * 40]
    bodies = [bad_video_body(model.name, b) for b in [*refused_at_router, undecodable_clip()]]
    before = {w.name: servekit.stats_of(dep)[w.name]["refused"] for w in _v_workers(dep)}
    refused = asyncio.run(servekit.run_all(dep.router_url, bodies))
    for got in refused:
        assert got["status"] == 400 and got["error"]["type"] == "invalid_request_error", got
        assert got["error"]["code"] in ("invalid_video", "unsupported_video_codec"), got
    assert "does not decode" in refused[-1]["error"]["message"]  # found by a V instance's decoder
    after = servekit.stats_of(dep)
    assert sum(after[n]["refused"] - before[n] for n in before) >= 1
    again = asyncio.run(servekit.run_all(dep.router_url, [SERVING_CASES[1].openai_body(model.name)]))
    assert again[0]["status"] == 200 and again[0]["token_ids"] == serving_expected(family)[1]
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def test_v_instance_loads_no_model(deployment) -> None:
    _family, _topology, dep = deployment
    for w in _v_workers(dep):
        s = httpx.get(f"{w.url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        assert s["role"] == "V" and s["weights_loaded"] is False, s
        assert s["model_modules"] == [], s  # no model family, model runner or transformers model code
        assert s["loaded"] == ["video_processor_config"]
        r = httpx.post(f"{w.url}/admin/role", json={"role": "E"}, headers=dep.admin_headers, timeout=10)
        assert r.status_code == 409
