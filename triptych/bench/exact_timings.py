"""Exact timings for the serving benchmark: each process's ring of recent records
(triptych/timings.py, `GET /admin/timings` under the admin token) read before and after a
rate, and their percentiles — per-request migration times (E->P, P->D) measured by the
pulling worker, and the router's own overhead per request (router/overhead.py). Without
an admin token (or against a server that has no such endpoint) the report keeps the
histogram-bucket estimates from /metrics and says so (`timings_source`)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from triptych.bench.stats import percentile
from triptych.timings import TimingRecord, TimingsPage

Marks = dict[str, int]  # process URL -> the `next` its ring gave


async def _page(client: httpx.AsyncClient, url: str, since: int, headers: Mapping[str, str]) -> TimingsPage | None:
    try:
        resp = await client.get(f"{url}/admin/timings", params={"since": since}, headers=dict(headers), timeout=10.0)
        resp.raise_for_status()
        return TimingsPage.model_validate_json(resp.content)
    except (httpx.HTTPError, ValidationError) as exc:
        print(f"warning: no exact timings from {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


async def timing_marks(client: httpx.AsyncClient, urls: Sequence[str], headers: Mapping[str, str]) -> Marks:
    """Where each process's ring stands now (processes that do not answer are left out)."""
    if not headers:
        return {}
    pages = await asyncio.gather(*(_page(client, u, 1 << 62, headers) for u in urls))
    return {u: p.next for u, p in zip(urls, pages, strict=True) if p is not None}


async def timings_since(client: httpx.AsyncClient, marks: Marks, headers: Mapping[str, str]) -> list[TimingRecord]:
    """Every record each process made after its mark (a warning if some fell off the ring)."""
    pages = await asyncio.gather(*(_page(client, u, seq, headers) for u, seq in marks.items()))
    out: list[TimingRecord] = []
    for url, page in zip(marks, pages, strict=True):
        if page is None:
            continue
        if page.dropped:
            print(f"warning: {url} dropped timing records (ring full); figures cover the rest", file=sys.stderr)
        out.extend(page.records)
    return out


def timing_figures(records: Iterable[TimingRecord]) -> dict[str, Any]:
    """Exact p50/p95 of migrations (by kind) and of the router's overhead per request, the
    p50 and p95 of each migration phase, and the counts they come from."""
    by_kind: dict[str, list[TimingRecord]] = {}
    for r in records:
        by_kind.setdefault(r.kind, []).append(r)
    out: dict[str, Any] = {"timings_source": "exact"}
    for kind in ("ep", "pd"):
        recs = by_kind.get(kind, [])
        secs = [r.seconds for r in recs]
        out[f"{kind}_migrations"] = len(secs)
        for q in (50, 95):
            out[f"{kind}_migration_p{q}_s"] = percentile(secs, q)
        names = sorted({name for r in recs for name in r.phases})
        for q in (50, 95):  # where the typical and the slow pulls spend their time
            out[f"{kind}_migration_phases_p{q}_s"] = {
                name: percentile([r.phases[name] for r in recs if name in r.phases], q) for name in names}
    overheads = [r.seconds for r in by_kind.get("request", [])]
    out["router_overhead_requests"] = len(overheads)
    out["router_overhead_p50_s"] = percentile(overheads, 50)
    out["router_overhead_p95_s"] = percentile(overheads, 95)
    return out
