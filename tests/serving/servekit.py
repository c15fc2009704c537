"""Helpers for serving tests: real local deployments (router + worker processes over
loopback HTTP and NIXL) and the request set whose outputs are checked against
transformers."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hf_reference import hf_generate, make_test_image, png_bytes
from PIL import Image

from triptych.local import LocalDeployment, Process
from triptych.processor import MultimodalProcessor
from triptych.tiny_model import tiny_model_path
from triptych.topology import parse_topology

tiny_dir = tiny_model_path  # the root conftest points TRIPTYCH_CACHE at the test builds

PROMPTS = [
    "Describe the picture.",
    "What colours do you see here, and which one covers the largest area of the image?",
    "Hi",
    "Tell me a story about the things in these pictures, one sentence each, in order.",
]


@dataclass
class Case:
    index: int
    images: list[Image.Image]
    prompt: str
    max_tokens: int
    stream: bool
    seed_base: int = 0
    pngs: list[bytes] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.pngs = [png_bytes(img) for img in self.images]

    def hf_messages(self) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in self.images]
        content.append({"type": "text", "text": self.prompt})
        return [{"role": "user", "content": content}]

    def openai_body(self, model: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
            for p in self.pngs]
        content.append({"type": "text", "text": self.prompt})
        return {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": self.stream,
                "return_token_ids": True, **({"ignore_eos": True} if self.ignore_eos else {})}


SIZES = [(56, 56), (84, 56), (56, 112), (112, 84)]


def make_cases(n: int = 16, max_tokens: int = 8, seed_base: int = 0) -> list[Case]:
    """n requests with 0-3 images each (distinct images), varied prompts and sizes."""
    cases = []
    for i in range(n):
        num_images = i % 4
        images = [make_test_image(seed_base + 100 * i + j, *SIZES[(i + j) % len(SIZES)]) for j in range(num_images)]
        cases.append(Case(i, images, PROMPTS[i % len(PROMPTS)], max_tokens, stream=i % 2 == 0))
    return cases


def expected_ids(model_dir: Path, case: Case) -> list[int]:
    return hf_generate(model_dir, case.hf_messages(), case.images, case.max_tokens, ignore_eos=case.ignore_eos)


def start(model_dir: Path, topology: str, tmp: Path, **kwargs: Any) -> LocalDeployment:
    dep = LocalDeployment(model=model_dir, topology=parse_topology(topology), transfer_require="nixl",
                          log_dir=tmp / f"logs-{topology}", startup_timeout_s=240, **kwargs)
    return dep.start()


async def chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion; returns {"text", "token_ids", "finish_reason", "error"} for both modes."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": data.get("error")}
        choice = data["choices"][0]
        return {"status": 200, "text": choice["message"]["content"], "token_ids": choice.get("token_ids"),
                "finish_reason": choice["finish_reason"], "usage": data["usage"]}
    text, ids, finish, error = "", [], None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": json.loads(await r.aread()).get("error")}
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            error = chunk["error"]
            continue
        for choice in chunk.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return {"status": 200, "text": text, "token_ids": ids, "finish_reason": finish, "error": error}


async def run_all(url: str, bodies: list[dict[str, Any]], timeout_s: float = 180.0) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        return await asyncio.gather(*(chat(client, url, b) for b in bodies))


def _text_config(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)


def kv_block_nbytes(model_dir: Path, block_size: int) -> int:
    """Bytes of one fp32 KV block of the checkpoint's language model."""
    text = _text_config(model_dir)
    heads = text["num_attention_heads"]
    kv_heads, head_dim = text.get("num_key_value_heads", heads), text.get("head_dim") or text["hidden_size"] // heads
    return text["num_hidden_layers"] * 2 * block_size * kv_heads * head_dim * 4


def metric_in(text: str, name: str) -> float:
    """Sum of an unlabelled (or any-labelled) sample `name` in a /metrics text."""
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def expected_transfer_bytes(model_dir: Path, cases: list[Case], worker_stats: dict[str, dict[str, Any]],
                            ) -> tuple[int, int]:
    """(MM bytes, KV bytes) that E->P and P->D pulls must have moved for these requests:
    blocks moved times the block size, from the checkpoint's shapes and the caches' layout."""
    hidden = _text_config(model_dir)["hidden_size"]
    any_kv = next(s["kv_cache"] for s in worker_stats.values() if "kv_cache" in s)
    any_mm = next(s["mm_cache"] for s in worker_stats.values() if "mm_cache" in s)
    block_size, rows = any_kv["block_size"], any_mm["rows_per_block"]
    kv_block = kv_block_nbytes(model_dir, block_size)
    mm_block = rows * hidden * 4
    proc = MultimodalProcessor.from_pretrained(model_dir)
    mm_bytes = kv_bytes = 0
    for case in cases:
        prompt = proc.process(case.hf_messages(), case.images)
        kv_bytes += math.ceil(len(prompt.token_ids) / block_size) * kv_block
        mm_bytes += sum(math.ceil(item.length / rows) * mm_block for item in prompt.mm_items)
    return mm_bytes, kv_bytes


# --- stats helpers shared by the hybrid-topology and failure tests -------------------------


def stats_of(dep: LocalDeployment, skip: Collection[str] = ()) -> dict[str, dict[str, Any]]:
    """`/admin/stats` of every worker whose name is not in `skip` (e.g. one just killed)."""
    out = {}
    for w in dep.workers:
        if w.name in skip:
            continue
        r = httpx.get(f"{w.url}/admin/stats", headers=dep.admin_headers, timeout=10)
        assert r.status_code == 200, (w.name, r.status_code, r.text[:500])
        out[w.name] = r.json()
    return out


def _busy(s: dict[str, Any]) -> bool:
    return bool(s.get("kv_cache", {}).get("used", 0) or s.get("mm_cache", {}).get("referenced", 0)
                or s["leases_outstanding"] or s["inflight"] or s.get("num_running", 0)
                or s.get("num_waiting", 0) or s.get("num_parked", 0))


def wait_idle(dep: LocalDeployment, timeout_s: float = 30.0, skip: Collection[str] = ()) -> dict[str, dict[str, Any]]:
    """Poll until no instance (outside `skip`) holds blocks, leases or requests; returns the
    last stats (the caller asserts on them, so a timeout shows what was still held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = stats_of(dep, skip)
        if not any(_busy(s) for s in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def assert_no_leaks(worker_stats: dict[str, dict[str, Any]]) -> None:
    for name, s in worker_stats.items():
        if "kv_cache" in s:
            # used: blocks a request or lease references. Prefix-cached blocks nobody
            # references stay cached but are free (evictable): every block can be allocated.
            kv = s["kv_cache"]
            assert kv["used"] == 0 and kv["free"] == kv["num_blocks"], (name, kv)
        if "mm_cache" in s:
            assert s["mm_cache"]["referenced"] == 0, (name, s["mm_cache"])
        assert s["leases_outstanding"] == 0 and s["inflight"] == 0, (name, s)
        assert s.get("num_running", 0) == 0 and s.get("num_waiting", 0) == 0 and s.get("num_parked", 0) == 0, \
            (name, s)


def counter(worker_stats: dict[str, dict[str, Any]], name: str, role: str | None = None) -> int:
    """Sum of one engine counter over the instances (of one role, if given)."""
    return sum(s.get("counters", {}).get(name, 0) for s in worker_stats.values()
               if role is None or s["role"] == role)


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample `name` on `url`/metrics over the series matching `labels`
    (0 when no series exists yet)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def prompt_tokens(model_dir: Path, cases: list[Case]) -> int:
    """Prompt tokens (image placeholders expanded) of all the cases together."""
    proc = MultimodalProcessor.from_pretrained(model_dir)
    return sum(len(proc.process(c.hf_messages(), c.images).token_ids) for c in cases)


def worker(dep: LocalDeployment, role: str, index: int = 0) -> Process:
    """The `index`-th worker process started with `role` (names are worker-<role>-<i>)."""
    return next(w for w in dep.workers if w.name == f"worker-{role}-{index}")


# --- `triptych serve` run as a user runs it -----------------------------------------------


@contextmanager
def serve_cli(port: int, topology: str, *flags: str, env: dict[str, str] | None = None,
              stderr: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """`python -m triptych.cli serve --model tiny` on `port`, stdout piped (it prints its URLs
    there), stderr to a file or nowhere; killed on the way out if the test left it running."""
    err = stderr.open("w") if stderr is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "triptych.cli", "serve", "--model", "tiny", "--topology",
                             topology, "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        if stderr is not None:
            err.close()


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout_s: float = 240.0,
                  stderr: Path | None = None) -> str:
    """The first line of `proc`'s stdout that contains `needle`; fails when the process
    closes its stdout first (with the tail of `stderr`, if given) or after timeout_s. A helper
    thread reads (readline blocks): a process that goes quiet cannot hold the test past
    its deadline. The thread stops at the line, so later reads see what follows it."""
    found: queue.Queue[str | None] = queue.Queue(maxsize=1)

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):
            if needle in line:
                found.put(line)
                return
        found.put(None)  # end of output: the process exited (or closed stdout)

    threading.Thread(target=read, daemon=True, name=f"wait-for-{needle}").start()
    try:
        line = found.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"no line with {needle!r} on stdout within {timeout_s} s") from None
    if line is None:
        try:
            code = proc.wait(timeout=10)  # stdout closes just before the exit
        except subprocess.TimeoutExpired:
            code = None
        tail = stderr.read_text()[-2000:] if stderr is not None else ""
        raise AssertionError(f"stdout closed (exit code {code}) before a line with {needle!r}: {tail}")
    return line


def children(pid: int) -> list[int]:
    """Pids of the direct children of `pid`."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True,
                         timeout=30).stdout
    return [int(p) for p in out.split()]


def stop_cleanly(proc: subprocess.Popen[str], started: Collection[int] = ()) -> None:
    """SIGTERM `serve`: it exits 0, and every process it `started` is gone."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
