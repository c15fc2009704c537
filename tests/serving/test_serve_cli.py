"""`triptych serve` (the README's main job) as a user runs it: it prints the URL, serves,
and on SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from triptych.local import free_port

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_serve_tiny_prints_url_serves_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "triptych.cli", "serve", "--model", "tiny", "--topology",
                             "1E1P1D", "--port", str(port), "--transfer-require", "nixl"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path)))
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "serving" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited before printing its URL"
        assert f"http://127.0.0.1:{port}/v1" in line
        children = _children(proc.pid)
        assert len(children) == 4  # three instances and the router
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        name = models["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": name, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert {k: v["ready"] for k, v in health["roles"].items()} == {"E": 1, "P": 1, "D": 1}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
