"""The HTTP client side of the serving benchmark: one timed streaming request, /metrics
scrapes, and discovery of the model name and worker URLs from a router."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from triptych.bench.errors import BenchError
from triptych.bench.prom_text import Sample, parse_metrics
from triptych.bench.stats import RequestResult, timeline_result


def _chunk_event(obj: dict[str, Any], seen: int) -> tuple[int, bool, int | None]:
    """(tokens delivered, has text, cumulative usage count) of one SSE chunk."""
    text = "".join(((c.get("delta") or {}).get("content") or c.get("text") or "")
                   for c in obj.get("choices") or [])
    usage = obj.get("usage") or None
    total = usage.get("completion_tokens") if usage else None
    if total is not None:
        return max(0, total - seen), bool(text), total
    return (1 if text else 0), bool(text), None


async def send_request(client: httpx.AsyncClient, url: str, body: bytes, timeout_s: float,
                       headers: dict[str, str] | None = None) -> RequestResult:
    """POST one streaming request and time its chunks. Never raises: failures are in
    `.error` (HTTP status, error event, timeout, connection error)."""
    start = time.perf_counter()
    events: list[tuple[float, int, bool]] = []
    seen, usage_total, request_id = 0, None, None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, content=body,
                                     headers={"content-type": "application/json", **(headers or {})}) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    return RequestResult(error=f"HTTP {resp.status_code}: {detail}")
                request_id = resp.headers.get("x-request-id")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        break
                    obj = json.loads(payload)
                    if "error" in obj:
                        return RequestResult(error=f"stream error: {obj['error'].get('message', obj['error'])}")
                    now = time.perf_counter() - start
                    tokens, has_text, total = _chunk_event(obj, seen)
                    if total is not None:
                        usage_total = total
                    if tokens or has_text:
                        events.append((now, tokens, has_text))
                        seen += tokens
    except TimeoutError:
        return RequestResult(error=f"timeout after {timeout_s:.0f}s")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}")
    result = timeline_result(events, time.perf_counter() - start, usage_total)
    result.request_id, result.sent_at = request_id, start
    return result


@dataclass
class Endpoints:
    router: str
    workers: list[str]
    headers: dict[str, str]
    admin_headers: dict[str, str] = field(default_factory=dict)  # for exact timings (exact_timings.py)

    @property
    def all(self) -> list[str]:
        return [self.router, *self.workers]


async def scrape(client: httpx.AsyncClient, urls: Sequence[str]) -> list[Sample]:
    """All samples of every URL's /metrics; a URL that does not answer is skipped (its
    figures are then missing from the report, which says so with a count of 0)."""
    async def one(url: str) -> list[Sample]:
        try:
            resp = await client.get(f"{url}/metrics", timeout=10.0)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            print(f"warning: could not scrape {url}/metrics: {exc}", file=sys.stderr)
            return []
        # One process's samples stay apart from another's: tag them with the instance.
        return [(n, (*labels, ("__instance", url)), v) for n, labels, v in parse_metrics(resp.text)]
    parts = await asyncio.gather(*(one(u) for u in urls))
    return [s for part in parts for s in part]


async def discover(client: httpx.AsyncClient, url: str, worker_urls: Sequence[str],
                   headers: dict[str, str]) -> tuple[str, Endpoints]:
    """The served model name (from /v1/models) and the worker URLs: `--worker-urls`, plus
    any the router's /health lists under `instances` or `workers`."""
    try:
        resp = await client.get(f"{url}/v1/models", headers=headers, timeout=10.0)
        resp.raise_for_status()
        model = resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"no model list at {url}/v1/models: {exc}") from exc
    found = list(worker_urls)
    try:
        health = (await client.get(f"{url}/health", timeout=10.0)).json()
    except (httpx.HTTPError, ValueError):
        health = {}
    for key in ("instances", "workers"):
        for item in health.get(key) or []:
            u = item.get("url") if isinstance(item, dict) else item
            if isinstance(u, str) and u.rstrip("/") not in found:
                found.append(u.rstrip("/"))
    return model, Endpoints(url, [u.rstrip("/") for u in found], headers)
