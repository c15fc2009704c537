"""A guided decode migrated mid-stream (a decode instance SIGTERM'd: it drains by handing
its running decodes to the other decode instance, EPDServe §3.2.4) keeps its grammar: the
instance that takes over replays the tokens sampled before it into a fresh matcher, and
every stream gives exactly the text of an uninterrupted run, valid against the schema."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import jsonschema
import pytest
import servekit
from servekit import tiny_dir

pytestmark = pytest.mark.slow

TOKEN = "guided-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
# Long enough to be caught mid-decode even when the tiny model decodes a step in a couple of
# milliseconds (the drain's pre-copy alone may take 0.25 s), bounded so every sample completes.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 240, "maxItems": 240}


def _bodies(model: str) -> list[dict]:
    fmt = {"type": "json_schema", "json_schema": {"name": "digits", "schema": SCHEMA, "strict": True}}
    return [{"model": model, "messages": [{"role": "user", "content": f"Digits, please ({i})."}],
             "temperature": 1, "seed": 4000 + i, "max_tokens": 1000, "stream": True, "return_token_ids": True,
             "response_format": fmt} for i in range(8)]


def test_sigterm_migrates_guided_decodes_exactly(tmp_path) -> None:
    model = tiny_dir("qwen2-vl")
    with servekit.start(model, "1P2D", tmp_path, admin_token=TOKEN) as dep:
        bodies = _bodies(model.name)
        baseline = asyncio.run(servekit.run_all(dep.router_url, bodies))
        victim, survivor = [w for w in dep.workers if "-D-" in w.name]

        def stats(w) -> dict:
            return httpx.get(f"{w.url}/admin/stats", timeout=10, headers=ADMIN).json()

        before = stats(survivor)["counters"]["migrated_in"]

        def terminate_when_decoding() -> None:
            deadline = time.monotonic() + 60
            while not stats(victim).get("num_running") and time.monotonic() < deadline:
                time.sleep(0.01)
            os.killpg(victim.popen.pid, signal.SIGTERM)
            victim.popen.wait(60)

        async def run() -> list[dict]:
            task = asyncio.ensure_future(servekit.run_all(dep.router_url, bodies))
            await asyncio.to_thread(terminate_when_decoding)
            return await task

        migrated = asyncio.run(run())
        taken_over = stats(survivor)["counters"]["migrated_in"] - before
    assert taken_over >= 1
    for want, got in zip(baseline, migrated, strict=True):
        assert want["status"] == 200 and got["status"] == 200 and not got.get("error"), got
        assert got["finish_reason"] == "stop" and got["token_ids"] == want["token_ids"]
        jsonschema.validate(json.loads(got["text"]), SCHEMA)
