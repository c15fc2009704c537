"""`triptych serve` (the README's main job) as a user runs it: it prints the URL, serves,
and on SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import servekit

from triptych.cpu_binding import parse_cpu_list
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


def _cpus_of(pid: int) -> dict[int, tuple[int, ...]]:
    """Each thread of `pid` and the CPUs it may run on."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        line = next(x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return out


def test_serve_binds_the_engine_to_its_own_cores_and_the_rest_to_the_others(tmp_path: Path) -> None:
    """`serve --cpu-binding auto` on a machine with a core to spare: the engine's step thread
    alone on its core(s); the worker's other threads and the router on the rest."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: an engine cannot have a core of its own (serve runs unbound)")
    port, err = free_port(), tmp_path / "serve.err"
    env = dict(os.environ, TRIPTYCH_ADMIN_TOKEN="binding-test")
    with servekit.serve_cli(port, "EPD", "--cpu-binding", "auto", env=env, stderr=err) as proc:
        servekit.wait_for_line(proc, "serving", stderr=err)
        found = re.search(r"CPU binding: engines: worker-EPD-0 on CPU (\S+); router and service threads on CPU (\S+)",
                          err.read_text())
        assert found, err.read_text()
        engine, service = parse_cpu_list(found[1]), parse_cpu_list(found[2])
        assert not set(engine) & set(service)
        kids = servekit.children(proc.pid)
        cmd = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3].decode() for pid in kids}
        worker = next(pid for pid, sub in cmd.items() if sub == "worker")
        router = next(pid for pid, sub in cmd.items() if sub == "router")
        threads = _cpus_of(worker)
        assert threads[worker] == service  # the event loop
        assert sorted(threads.values()).count(engine) == 1  # the step thread, alone
        assert set(_cpus_of(router).values()) == {service}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "qwen2-vl-tiny-s0", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                             "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        servekit.stop_cleanly(proc, kids)


def test_serve_with_a_stream_interval_streams_the_same_tokens_in_fewer_chunks(tmp_path: Path) -> None:
    """`serve --stream-interval 4`: a streamed greedy completion has the tokens the
    unstreamed one has; after the first token they come four at a time."""
    port, err = free_port(), tmp_path / "serve.err"
    env = dict(os.environ, TRIPTYCH_ADMIN_TOKEN="interval-test")
    body = {"model": "qwen2-vl-tiny-s0", "max_tokens": 13, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "messages": [{"role": "user", "content": "Count with me"}]}
    with servekit.serve_cli(port, "EPD", "--stream-interval", "4", env=env, stderr=err) as proc:
        servekit.wait_for_line(proc, "serving", stderr=err)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["token_ids"]
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ids = [c["choices"][0].get("token_ids") or [] for c in chunks if c.get("choices")]
        ids = [x for x in ids if x]
        assert [t for x in ids for t in x] == whole and len(whole) == 13
        # Threes of fours, after the first token alone (a stream the router reads late
        # takes several at once: a multiple of 4).
        assert len(ids) >= 2 and len(ids[0]) % 4 == 1 and all(len(x) % 4 == 0 for x in ids[1:]), ids
        servekit.stop_cleanly(proc, servekit.children(proc.pid))
