"""Request lifecycles through real processes: load, disconnects, lease expiry, a decode
instance killed mid-stream, and role switches. Afterwards no instance holds a block."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import servekit
from servekit import tiny_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def epd3(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "1E1P1D", tmp_path_factory.mktemp("epd3"),
                        # Long enough that 64 concurrent hand-offs on a busy machine are pulled
                        # in time: a pull that cannot finish before its lease ends is refused
                        # (never read), and hand-offs here can wait several seconds.
                        worker_args=["--lease-seconds", "30"]) as dep:
        yield model, dep


def _long_body(model: Path, case: servekit.Case, max_tokens: int = 400) -> dict:
    body = case.openai_body(model.name)
    body.update(stream=True, max_tokens=max_tokens, ignore_eos=True)
    return body


def test_64_concurrent_streams_complete_and_free_everything(epd3) -> None:
    model, dep = epd3
    cases = servekit.make_cases(64, max_tokens=6, seed_base=7000)
    for c in cases:
        c.stream = True
    results = asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(model.name) for c in cases]))
    assert all(r["status"] == 200 and not r["error"] and r["finish_reason"] for r in results), results
    servekit.assert_no_leaks(servekit.wait_idle(dep))


async def _disconnect_after(url: str, body: dict, tokens: int) -> int:
    seen = 0
    async with httpx.AsyncClient(timeout=60) as client, \
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                seen += 1
                if seen >= tokens:
                    break  # leaving the block closes the connection mid-stream
    return seen


def test_client_disconnect_mid_stream_frees_blocks(epd3) -> None:
    model, dep = epd3
    cases = servekit.make_cases(8, seed_base=8000)
    bodies = [_long_body(model, c) for c in cases]

    async def go() -> list[int]:
        return await asyncio.gather(*(_disconnect_after(dep.router_url, b, 3) for b in bodies))

    assert all(n == 3 for n in asyncio.run(go()))
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def _expired_kv(metrics: str) -> float:
    line = next((x for x in metrics.splitlines() if x.startswith('triptych_worker_lease_expired_total{region="kv"}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def test_unclaimed_handoff_expires_and_frees(epd3) -> None:
    """A P instance hands off KV that no D ever pulls: its lease expires and frees the blocks."""
    model, dep = epd3
    args = dep.worker_args
    dep.worker_args = ["--lease-seconds", "3"]  # its own P, with a lease short enough to wait out
    try:
        p = dep.start_worker("P", 9)
    finally:
        dep.worker_args = args
    try:
        dep.wait_ready([p])
        _unclaimed_handoff(model, dep, p)
    finally:
        p.popen.kill()
        p.popen.wait(timeout=10)


def _unclaimed_handoff(model: Path, dep, p) -> None:
    from triptych.processor import MultimodalProcessor

    ids = MultimodalProcessor.from_pretrained(model).process(
        [{"role": "user", "content": "Hello there, this is a prompt."}], []).token_ids
    sreq = {"request_id": "orphan-1", "stages": ["prefill"], "prompt_token_ids": ids,
            "sampling": {"temperature": 0, "max_tokens": 50, "ignore_eos": True}}
    expired_before = _expired_kv(httpx.get(f"{p.url}/metrics").text)
    with httpx.stream("POST", f"{p.url}/internal/run", json=sreq, headers=dep.internal_headers, timeout=30) as r:
        events = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert [e["type"] for e in events] == ["prefilled"], events
    held = httpx.get(f"{p.url}/admin/stats", headers=dep.admin_headers).json()
    assert held["kv_cache"]["used"] == len(events[0]["kv"]["handle"]["block_ids"]) > 0
    assert held["leases_outstanding"] == 1
    handle = events[0]["kv"]["handle"]
    for path in ("/health", "/ready", "/live", "/metrics"):  # open endpoints hold no secret of the lease
        text = httpx.get(f"{p.url}{path}").text
        assert handle["agent_metadata"] not in text and handle["lease_secret"] not in text, path
        assert handle["lease_id"] not in text and dep.internal_token not in text, path
    assert httpx.post(f"{p.url}/internal/run", json=sreq).status_code == 401  # no token, no handle
    time.sleep(3.5)  # --lease-seconds 3
    after = httpx.get(f"{p.url}/admin/stats", headers=dep.admin_headers).json()
    assert after["kv_cache"]["used"] == 0 and after["leases_outstanding"] == 0
    metrics = httpx.get(f"{p.url}/metrics").text
    assert _expired_kv(metrics) == expired_before + 1


def test_decode_killed_mid_stream_gives_error_event_then_recovers(epd3) -> None:
    model, dep = epd3
    d = next(w for w in dep.workers if "-D-" in w.name)
    body = _long_body(model, servekit.make_cases(1, seed_base=9000)[0], max_tokens=3000)
    lines: list[str] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{dep.router_url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) == 5:
                os.killpg(d.popen.pid, signal.SIGKILL)
    elapsed = time.monotonic() - started
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][len("data: "):]), lines[-3:]
    assert elapsed < 60
    # The router keeps serving: with no decode instance it says so; once one is back, it works.
    r = httpx.post(f"{dep.router_url}/v1/chat/completions",
                   json={**body, "stream": False, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and "error" in r.json()
    dep.restart_worker(d)
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(f"{dep.router_url}/v1/chat/completions",
                       json={**body, "stream": False, "max_tokens": 4}, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    servekit.assert_no_leaks(servekit.wait_idle(dep))


def test_role_switch_unassigned_to_p_then_d(tmp_path: Path) -> None:
    model = tiny_dir("qwen2-vl")
    cases = servekit.make_cases(4, seed_base=500)
    for c in cases:
        c.stream = False
    expected = [servekit.expected_ids(model, c) for c in cases]
    with servekit.start(model, "1E1P1D", tmp_path, extra_roles=["unassigned"]) as dep:
        u = next(w for w in dep.workers if "unassigned" in w.name)
        assert httpx.get(f"{u.url}/health").json()["role"] == "unassigned"
        # Alive but holding no capacity: not ready until it serves a role (Kubernetes keeps it
        # out of the endpoints; the operator assigns it a role).
        assert httpx.get(f"{u.url}/ready").status_code == 503 and httpx.get(f"{u.url}/live").status_code == 200
        for role, counter in (("P", "prefill_tokens"), ("D", "decode_tokens")):
            r = httpx.post(f"{u.url}/admin/role", json={"role": role}, headers=dep.admin_headers,
                           timeout=120)
            assert r.status_code == 200 and r.json()["role"] == role
            time.sleep(1.5)  # the router sees the new role at its next health poll
            for _ in range(2):  # round-robin: every request pair touches the switched instance
                results = asyncio.run(servekit.run_all(dep.router_url,
                                                       [c.openai_body(model.name) for c in cases]))
                assert [r["token_ids"] for r in results] == expected
            s = httpx.get(f"{u.url}/admin/stats", headers=dep.admin_headers).json()
            assert s["role"] == role and s["counters"][counter] > 0
        bad = httpx.post(f"{u.url}/admin/role", json={"role": "XYZ"}, headers=dep.admin_headers)
        assert bad.status_code == 400


def test_worker_keeps_an_idle_connection_longer_than_the_router_does(epd3) -> None:
    """A worker keeps an idle keep-alive connection open past httpx's and uvicorn's 5 s
    default, so the router (which drops idle connections first) never sends a stage call
    on a connection the worker is closing: such a hop failed mid-stream with an empty
    ReadError while the worker was healthy."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    _, dep = epd3
    url = urlsplit(dep.workers[0].url)
    conn = HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/live")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        time.sleep(6.5)  # past the 5 s default keep-alive
        conn.request("GET", "/live")  # on the same socket; a closed one raises here or below
        second = conn.getresponse()
        assert second.status == 200 and second.read() and conn.sock is sock
    finally:
        conn.close()
