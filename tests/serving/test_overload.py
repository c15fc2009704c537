"""Overload control (429 + Retry-After) and SIGTERM drain, through real processes."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import servekit
from servekit import tiny_dir

pytestmark = pytest.mark.slow


def _body(model: Path, max_tokens: int, seed_base: int, images: bool = False) -> dict:
    case = servekit.make_cases(2, seed_base=seed_base)[1 if images else 0]
    body = case.openai_body(model.name)
    body.update(stream=True, max_tokens=max_tokens, ignore_eos=True)
    return body


def test_overload_gets_429_with_retry_after_and_recovers(tmp_path: Path) -> None:
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "EPD", tmp_path, router_args=["--max-inflight-requests", "2"]) as dep:
        bodies = [_body(model, 200, 10 + i) for i in range(6)]
        results = asyncio.run(servekit.run_all(dep.router_url, bodies))
        refused = [r for r in results if r["status"] == 429]
        served = [r for r in results if r["status"] == 200]
        assert len(served) >= 2 and len(refused) >= 1, [r["status"] for r in results]
        assert all(r["finish_reason"] == "length" and not r["error"] for r in served)
        assert all(r["error"]["type"] and "busy" in r["error"]["message"] for r in refused)
        r = httpx.post(f"{dep.router_url}/v1/chat/completions", json={**bodies[0], "stream": False,
                                                                      "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        # Retry-After rides on the 429 itself.
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(f"{dep.router_url}/v1/chat/completions",
                                                          json={**b, "stream": False}) for b in bodies))
        responses = asyncio.run(burst())
        too_many = [r for r in responses if r.status_code == 429]
        assert too_many and all(float(r.headers["retry-after"]) > 0 for r in too_many)
        metrics = httpx.get(f"{dep.router_url}/metrics").text
        assert 'outcome="overloaded"' in metrics


def test_sigterm_drains_inflight_work_then_exits(tmp_path: Path) -> None:
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "1P2D", tmp_path) as dep:
        decoders = [w for w in dep.workers if "-D-" in w.name]
        body = _body(model, 300, 77)
        result: dict = {}

        def stream() -> None:
            result.update(asyncio.run(servekit.run_all(dep.router_url, [body]))[0])

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        busy = None
        while busy is None and time.monotonic() < deadline:
            for d in decoders:
                if httpx.get(f"{d.url}/admin/stats", headers=dep.admin_headers).json()["inflight"]:
                    busy = d
            time.sleep(0.05)
        assert busy is not None, "the stream never reached a decode instance"
        busy.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            health = httpx.get(f"{busy.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
        except httpx.ConnectError:
            pass  # drained already: its decode migrated to the other D instance (role switching, issue 9)
        busy.popen.wait(60)  # it exits while the stream goes on: its decode moved to the other D
        # New work goes elsewhere while it drains.
        other = asyncio.run(servekit.run_all(dep.router_url, [{**body, "max_tokens": 5}]))[0]
        assert other["status"] == 200 and other["finish_reason"] == "length"
        t.join(timeout=120)
        assert result["status"] == 200 and result["finish_reason"] == "length" and not result["error"]
        assert len(result["token_ids"]) == 300
        # uvicorn re-raises the signal once its graceful shutdown is over, so the exit
        # status says "terminated by SIGTERM" -- after the drain, not before.
        assert busy.popen.wait(timeout=30) in (0, -signal.SIGTERM)
