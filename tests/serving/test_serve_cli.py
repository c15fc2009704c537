"""`triptych serve` (the README's main job) as a user runs it: it prints the URL, serves,
and on SIGTERM stops every process it started."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import servekit

from triptych.local import free_port

pytestmark = pytest.mark.slow


def test_serve_tiny_prints_url_serves_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    with servekit.serve_cli(port, "1E1P1D", "--transfer-require", "nixl",
                            env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path))) as proc:
        line = servekit.wait_for_line(proc, "serving")
        assert f"http://127.0.0.1:{port}/v1" in line
        children = servekit.children(proc.pid)
        assert len(children) == 4  # three instances and the router
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        name = models["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": name, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert {k: v["ready"] for k, v in health["roles"].items()} == {"E": 1, "P": 1, "D": 1}
        servekit.stop_cleanly(proc, children)
