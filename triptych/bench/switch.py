"""`triptych bench switch`: how long a role switch takes, as `POST /admin/role` reports
it, and what a migrated decode costs the streams that were running.

It starts a local deployment (2E2P2D by default) and switches, one after another, a
decode instance to P, a prefill instance to D, an encode instance to D and back to E
(issue 9's cycle, EPDServe §3.2.4). Each switch runs twice: on an idle deployment (the
switch's own cost) and under `--concurrency` streaming requests (ignore_eos), where a
D->X switch waits until the instance runs decodes, so that they migrate.

`pre-copy ms` is the part of the switch during which the decodes to be moved still run
here while their new instances pull their full KV blocks (live migration); a P <-> D
switch answers once the new role runs and its decodes move out after the reply
(`last_switch.precopy_s`, from the switch's start), and so does a D/P -> E switch with
decodes running, once the vision tower it loads is in (`freed ms`: when the language model
and its KV cache went, after the decodes left; `last_switch.parts_freed_s`); an idle
D/P -> E frees them before it answers. For each stream it reports how much its largest inter-token gap exceeds its mean gap
(TPOT), in mean gaps ("added gaps"): a decode moved to another instance mid-stream pauses once,
for the pull and the hop. `migrated gaps` is the maximum over the streams that moved — the
switched instance's `/admin/stats` `last_switch.migrated_ids` names them by request id (the
router's X-Request-Id; a decode's later hops run as `<id>.dN`) — counting only the gaps that
ended after the switch was asked for (a D->X switch is asked `--steady` seconds after the
instance runs `--min-running` decodes — or its round-robin share of the streams, if that is
fewer — once their admissions settled); `others' gaps` the
same over the streams that did not move (what the switch cost everyone: on a shared CPU, the
migration's work slows the other instances too; `--instance-cpus` gives each its own share),
and `max added gaps` the maximum over every stream of the switch, whole streams. `hop gaps` is the migration's own
cost: in each moved stream, the pause from its last token at the old instance to its first
at the new one (the switched instance's `last_switch.moved_tokens` says how many tokens each
had streamed when it moved) less one TPOT, in TPOTs (the largest over the moved streams).
`hop net` is the same less, instead of one TPOT, the pause the streams that did not move had
at that moment where it is longer (their median gap spanning the hop's middle): on shared cores every stream
stalls together at times (the router relays nothing for tens of ms while the workers run),
and `hop net` is what the hop added beyond such a stall; `hop gaps (new TPOT)` counts the same gap in
the stream's TPOT at its new instance (the mean of its next 8 gaps: a move into a bigger batch
slows the stream for good, which is capacity, not the hop). `hop ms` splits a moved stream's hop
(the median over the moved streams, ms): from the source's park until the target read the
hand-over, until it handed the decode to its engine, until its first token left, until the
client had it (`hop_parts`; the targets' `/admin/stats` `recent_takeovers`). `hand-over ms`: from the switch's start until the
last decode it parked was pulled by its new instance (`last_switch.handover_s`; a P <-> D
switch answers before its decodes are even parked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from triptych.bench.client import send_request
from triptych.bench.errors import BenchError
from triptych.bench.report import fmt, progress
from triptych.bench.stats import RequestResult
from triptych.bench.workload import Workload, build_bodies
from triptych.topology import InstanceType, Stage

CYCLE = (("D", "P"), ("P", "D"), ("E", "D"), ("E", "E"))  # (instance picked by its first role, new role)


def _instances(client: httpx.Client, dep: Any) -> list[dict[str, Any]]:
    # 503 while a stage has no instance (1E1P2D after E->D): the list is there all the same
    return client.get(f"{dep.router_url}/health", headers=dep.admin_headers, timeout=10).json()["instances"]


def _switch(client: httpx.Client, dep: Any, instance: str, role: str) -> dict[str, Any]:
    resp = client.post(f"{dep.router_url}/admin/role", json={"instance": instance, "role": role},
                       headers=dep.admin_headers, timeout=300)
    if resp.status_code != 200:
        raise BenchError(f"switching {instance} to {role}: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def _wait_decoding(client: httpx.Client, dep: Any, url: str, min_running: int, timeout_s: float = 60) -> None:
    """Until the instance at `url` runs `min_running` requests (or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = client.get(f"{url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        if stats.get("num_running", 0) >= min_running:
            return
        time.sleep(0.005)


def _share(client: httpx.Client, dep: Any, min_running: int, streams: int) -> int:
    """The decodes to wait for on the instance about to switch: `min_running`, or fewer
    where round-robin cannot give it that many (4 streams over 3 decode instances give
    one of them a single decode, and a wait for two would sit out its whole timeout)."""
    decoders = sum(1 for i in _instances(client, dep)
                   if i["role"] in InstanceType.__members__ and InstanceType(i["role"]).runs(Stage.DECODE))
    return max(1, min(min_running, streams // max(1, decoders)))


def _arrivals(result: RequestResult) -> list[float]:
    """Each output token's arrival as a `time.perf_counter()` value (none if unknown)."""
    return [] if result.sent_at is None else [result.sent_at + t for t in result.token_times]


def gaps_after(result: RequestResult, t0: float) -> list[float]:
    """The stream's gaps that ended after `t0` (a `time.perf_counter()` value), but its first:
    the pause from its prefill's token to its first decode step (the P -> D hop of its
    admission, under a loaded switch often still under way when the switch was asked: up
    to 0.9 s behind 16 streams admitted at once at a quarter of a core) is the stream's
    admission, not the switch."""
    times = _arrivals(result)
    return [b - a for a, b in zip(times[1:], times[2:], strict=False) if b >= t0]


def added_gaps(result: RequestResult, since: float | None = None) -> float | None:
    """(largest gap - mean gap) / mean gap of one stream, the mean being its TPOT; None
    under 4 gaps. (Not the median: chunks read back to back give near-zero gaps.) With
    `since` (a `time.perf_counter()` value), the largest of the gaps that ended after it
    (`gaps_after`): a switch's own pause, not the stream's admission."""
    tpot = result.tpot
    if tpot is None or tpot <= 0 or len(result.gaps) < 4:
        return None
    gaps = result.gaps if since is None else gaps_after(result, since)
    return (max(gaps) - tpot) / tpot if gaps else None


def hop_span(result: RequestResult, moved_tokens: int, cut: int | None = None) -> tuple[float, float] | None:
    """When a moved stream's hop began and ended (`time.perf_counter()` values): the arrival
    of its last token from the old instance, token `moved_tokens` (the tokens it had when it
    moved, `last_switch.moved_tokens`), and of its first from the new one. A decode handed
    over live (make-before-break) went on at its source until the router cut over at output
    index `cut` (its target's `recent_takeovers` `lead_index`): its hop is the gap before
    that token. None when the stream did not get that far."""
    times = _arrivals(result)
    last_old = moved_tokens if cut is None else cut
    if not 1 <= last_old < len(times):
        return None
    return times[last_old - 1], times[last_old]


def max_gap_over(result: RequestResult, start: float, end: float) -> float | None:
    """The stream's longest gap that overlaps [start, end] (seconds; None if none does)."""
    times = _arrivals(result)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > start and a < end]
    return max(gaps) if gaps else None


def hop_gap(result: RequestResult, moved_tokens: int, concurrent: float = 0.0,
            cut: int | None = None) -> float | None:
    """The added gaps of the pause a migration put in the stream: its gap over the hop
    (`hop_span`: from its last token at the old instance to its first at the new one),
    less one TPOT, in TPOTs. With `concurrent` (seconds: the longest pause the streams that
    did not move had over that same span), less that pause instead where it is longer:
    what the hop added beyond a stall every stream had."""
    tpot = result.tpot
    span = hop_span(result, moved_tokens, cut)
    if tpot is None or tpot <= 0 or span is None:
        return None
    longest = max_gap_over(result, *span)
    return None if longest is None else (longest - max(tpot, concurrent)) / tpot


LOCAL_GAPS = 8  # the gaps after a hop that give the stream's TPOT at its new instance


def hop_gap_at_target(result: RequestResult, moved_tokens: int, cut: int | None = None) -> float | None:
    """The hop's gap (`hop_span`) less the stream's TPOT at its new instance, in those TPOTs:
    the mean of its next `LOCAL_GAPS` gaps. Where the move lands the decode in a bigger
    batch, its gaps grow for good (the instance's capacity, not the hop); this counts the
    hop in the stream's gaps as they are from then on. None without a hop or gaps after it."""
    times = _arrivals(result)
    span = hop_span(result, moved_tokens, cut)
    if span is None:
        return None
    first_new = moved_tokens if cut is None else cut  # the new instance's first token (hop_span)
    after = min(LOCAL_GAPS, len(times) - 1 - first_new)
    local = (times[first_new + after] - times[first_new]) / after if after else 0.0
    return None if local <= 0 else (span[1] - span[0] - local) / local


def _moved_spans(results: list[RequestResult], moved_tokens: dict[str, int], cuts: dict[str, int]) -> Iterator[
        tuple[RequestResult, tuple[float, float]]]:
    """Each moved stream (by request id in `moved_tokens`) that got past its hop, with the
    hop's span (`hop_span`; `cuts`: where live hand-overs were cut over)."""
    for r in results:
        span = hop_span(r, moved_tokens[r.request_id], cuts.get(r.request_id)) \
            if r.ok and r.request_id in moved_tokens else None
        if span is not None:
            yield r, span


def _max_hop_gap(results: list[RequestResult], moved_tokens: dict[str, int], cuts: dict[str, int],
                 others: list[RequestResult] | None = None) -> float | None:
    """The largest hop gap over the moved streams (`moved_tokens`: the tokens each had when
    it moved, by request id); with `others` (the streams that did not move), each net of
    their median longest pause over that hop's span (`hop_gap`'s `concurrent`)."""
    hops = []
    for r, span in _moved_spans(results, moved_tokens, cuts):
        concurrent = 0.0
        if others is not None:
            paused = sorted(g for g in (max_gap_over(o, *span) for o in others if o.ok) if g is not None)
            if not paused:
                continue  # nothing to compare with
            concurrent = paused[len(paused) // 2]
        hop = hop_gap(r, moved_tokens[r.request_id], concurrent, cuts.get(r.request_id))
        if hop is not None:
            hops.append(hop)
    return round(max(hops), 2) if hops else None


HOP_PARTS = ("park_to_handover", "handover_to_admitted", "admitted_to_first_token", "first_token_to_client")


def hop_parts(parked_at: float | None, moments: dict[str, Any], client_first: float) -> dict[str, float] | None:
    """Where one moved stream's hop went, in seconds (all wall clock, `time.time()`): from
    the source's park (`last_switch.parked_at`) until the target read the hand-over (the
    source's step in flight, its `migrating` event, the router), until the target handed
    the decode to its engine (the pull of the last blocks), until its first token left (the
    target's step in flight, the step the decode joined; the target's `recent_takeovers`
    moments), until the client had it (the router's relay). None without every moment."""
    handed, admitted, first = (moments.get(k) for k in ("handed_over_at", "admitted_at", "first_token_at"))
    if parked_at is None or handed is None or admitted is None or first is None:
        return None
    return {"park_to_handover": handed - parked_at, "handover_to_admitted": admitted - handed,
            "admitted_to_first_token": first - admitted, "first_token_to_client": client_first - first}


def hop_breakdown(results: list[RequestResult], moved_tokens: dict[str, int], cuts: dict[str, int],
                  parked_at: float | None, takeovers: dict[str, dict[str, Any]],
                  wall_minus_perf: float) -> dict[str, float] | None:
    """`hop_parts`' median over the moved streams (by the router's request id in
    `moved_tokens` and `takeovers`); `wall_minus_perf` turns the client's
    `time.perf_counter()` arrivals into wall clock."""
    parts: dict[str, list[float]] = {k: [] for k in HOP_PARTS}
    for r, span in _moved_spans(results, moved_tokens, cuts):
        got = hop_parts(parked_at, takeovers.get(r.request_id, {}), span[1] + wall_minus_perf)
        for k, v in (got or {}).items():
            parts[k].append(v)
    if not parts[HOP_PARTS[0]]:
        return None
    return {k: round(sorted(v)[len(v) // 2], 6) for k, v in parts.items()}


def _takeovers(client: httpx.Client, dep: Any) -> dict[str, dict[str, Any]]:
    """Every instance's `recent_takeovers`, by the router's request id (a takeover runs as
    `<id>.tN`); the latest of a request's."""
    out: dict[str, dict[str, Any]] = {}
    for inst in _instances(client, dep):
        stats = client.get(f"{inst['url']}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        for moments in stats.get("recent_takeovers", []):
            rid = moments["request_id"].split(".")[0]
            if rid not in out or (moments.get("opened_at") or 0) > (out[rid].get("opened_at") or 0):
                out[rid] = moments
    return out


def _max_of(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(max(got), 2) if got else None


def _max_added(results: list[RequestResult], since: float | None) -> float | None:
    added = [a for a in (added_gaps(r, since) for r in results if r.ok) if a is not None]
    return round(max(added), 2) if added else None


async def _streams_while(dep: Any, bodies: Sequence[bytes], during: Any,
                         timeout_s: float) -> tuple[list[RequestResult], dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        url = f"{dep.router_url}/v1/chat/completions"
        tasks = [asyncio.create_task(send_request(client, url, b, timeout_s)) for b in bodies]
        report = await asyncio.to_thread(during)
        return list(await asyncio.gather(*tasks)), report


def _cycle(dep: Any, cfg: argparse.Namespace, model: str, loaded: bool) -> list[dict[str, Any]]:
    rows = []
    with httpx.Client(trust_env=False) as client:
        first = {}
        for inst in _instances(client, dep):
            first.setdefault(inst["role"], inst)
        for n, (picked_by, role) in enumerate(CYCLE):
            inst = first[picked_by]
            label = f"{inst['instance_id']}: {_current_role(client, dep, inst['instance_id'])}->{role}"

            switch_at: list[float] = []  # when the switch was asked for

            def during(i: dict[str, Any] = inst, r: str = role, asked: list[float] = switch_at) -> dict[str, Any]:
                if loaded and _current_role(client, dep, i["instance_id"]) == "D":
                    _wait_decoding(client, dep, i["url"], _share(client, dep, cfg.min_running, cfg.concurrency))
                    time.sleep(cfg.steady)
                elif loaded:
                    time.sleep(cfg.switch_after)
                asked.append(time.perf_counter())
                return _switch(client, dep, i["instance_id"], r)

            if not loaded:
                results, report = [], during()
            else:
                work = Workload(num_requests=cfg.concurrency, images_per_request=cfg.images, prompt_len=16,
                                output_len=cfg.output_len)
                bodies = build_bodies(work, model, seed=100 + n)
                results, report = asyncio.run(_streams_while(dep, bodies, during, cfg.request_timeout))
            failed = [r.error for r in results if not r.ok]
            # A live switch that drops the language model frees it once its decodes left.
            last = _last_switch(client, dep, inst["url"], freeing="preload_s" in report and "migrating" in report)
            moved = {i.split(".")[0] for i in last.get("migrated_ids", [])}
            # By the router's request id (a later hop's worker id is `<id>.tN` / `<id>.dN`).
            moved_tokens = {i.split(".")[0]: n for i, n in last.get("moved_tokens", {}).items()}
            takeovers = _takeovers(client, dep) if moved else {}
            # Live hand-overs: where the router cut over to the target (its first token's index).
            cuts = {i: m["lead_index"] for i, m in takeovers.items() if i in moved and m.get("lead_index")}
            since = switch_at[0] if switch_at else None
            migrated_results = [r for r in results if r.request_id in moved]
            others = [r for r in results if r.request_id not in moved]
            # A live P <-> D switch answered before its decodes moved out: their pre-copy
            # (from the switch's start) and how many moved are in `last_switch`.
            live = bool(report.get("migrating"))
            row = {"switch": label, "loaded": loaded, "live": live, **{k: report[k] for k in
                   ("offload_s", "migrate_s", "onload_s", "total_s", "migrated", "handed_back")},
                   "precopy_s": last.get("precopy_s") if live else report.get("precopy_s", 0.0),
                   **({"migrated": len(last.get("migrated_ids", []))} if live else {}),
                   "handover_s": last.get("handover_s"), "parts_freed_s": last.get("parts_freed_s"),
                   "requests": len(results), "failed": len(failed),
                   "max_added_gaps": _max_added(results, None),
                   "migrated_added_gaps": _max_added(migrated_results, since),
                   "hop_added_gaps": _max_hop_gap(migrated_results, moved_tokens, cuts),
                   "hop_net_gaps": _max_hop_gap(migrated_results, moved_tokens, cuts, others),
                   "hop_target_gaps": _max_of(hop_gap_at_target(r, moved_tokens[r.request_id], cuts.get(r.request_id))
                                              for r, _ in _moved_spans(migrated_results, moved_tokens, cuts)),
                   "moved_live": len(cuts),
                   "hop_ms": None if not moved else hop_breakdown(
                       migrated_results, moved_tokens, cuts, last.get("parked_at"), takeovers,
                       time.time() - time.perf_counter()),
                   "others_added_gaps": _max_added(others, since)}
            progress(f"  {label} ({'loaded' if loaded else 'idle'}): total {report['total_s'] * 1000:.1f} ms, "
                     f"migrated {report['migrated']}, failed {len(failed)}")
            if failed:
                progress(f"    e.g. {failed[0]}")
            rows.append(row)
            time.sleep(cfg.settle)  # the router sees the new role at its next poll
    return rows


def _last_switch(client: httpx.Client, dep: Any, url: str, freeing: bool = False) -> dict[str, Any]:
    """The instance's record of its last in-place switch (`/admin/stats` `last_switch`);
    with `freeing`, once it has also freed the parts the new role drops."""
    deadline = time.monotonic() + 30  # a live switch's hand-overs may still be confirming
    while True:
        stats = client.get(f"{url}/admin/stats", headers=dep.admin_headers, timeout=10).json()
        last = stats.get("last_switch") or {}
        done = last.get("handover_s") is not None or not last.get("handover_pending")
        if (done and (not freeing or "parts_freed_s" in last)) or time.monotonic() > deadline:
            return last
        time.sleep(0.05)


def _current_role(client: httpx.Client, dep: Any, instance_id: str) -> str:
    return next(i["role"] for i in _instances(client, dep) if i["instance_id"] == instance_id)


def run(cfg: argparse.Namespace) -> dict[str, Any]:
    from triptych.cli_args import resolve_model
    from triptych.local import LocalDeployment
    from triptych.topology import parse_topology

    model_dir = resolve_model(cfg.model)
    dep = LocalDeployment(log_dir=Path(cfg.log_dir) if cfg.log_dir else None, model=model_dir, topology=parse_topology(cfg.topology), transfer_require="nixl",
                          instance_cpus=cfg.instance_cpus, cpu_period_ms=cfg.instance_cpu_period_ms,
                          cpu_priority=cfg.priority)
    progress(f"== {cfg.topology}, {cfg.concurrency} streams of {cfg.output_len} tokens under load"
             + (f", {cfg.instance_cpus:g} CPU per instance" if cfg.instance_cpus else ""))
    with dep:
        if cfg.instance_cpus and dep.quota is None:
            progress(f"  no CPU quota could be set: {dep.quota_error}")
        with httpx.Client(trust_env=False) as client:
            model = client.get(f"{dep.router_url}/v1/models", timeout=10).json()["data"][0]["id"]
        warm = build_bodies(Workload(num_requests=4, images_per_request=cfg.images, prompt_len=16, output_len=8),
                            model, seed=7)
        asyncio.run(_streams_while(dep, warm, lambda: {}, cfg.request_timeout))
        rows = _cycle(dep, cfg, model, loaded=False) + _cycle(dep, cfg, model, loaded=True)
    return {"topology": cfg.topology, "concurrency": cfg.concurrency, "output_len": cfg.output_len,
            "instance_cpus": cfg.instance_cpus, "switches": rows}


def format_table(report: dict[str, Any]) -> str:
    head = ("switch", "load", "pre-copy ms", "offload ms", "migrate ms", "onload ms", "total ms", "migrated (live)",
            "hand-over ms", "freed ms",
            "handed back", "failed", "hop gaps", "hop net", "hop gaps (new TPOT)", "hop ms: hand-over/admit/token/client",
            "migrated gaps",
            "others' gaps", "max added gaps")
    rows = [head]
    for r in report["switches"]:
        rows.append((r["switch"], "streams" if r["loaded"] else "idle", fmt(r.get("precopy_s"), 1000, 1),
                     fmt(r["offload_s"], 1000, 1),
                     fmt(r["migrate_s"], 1000, 1), fmt(r["onload_s"], 1000, 1), fmt(r["total_s"], 1000, 1),
                     f"{r['migrated']} ({r.get('moved_live', 0)})", fmt(r["handover_s"], 1000, 1) if r["migrated"] else "-",
                     fmt(r.get("parts_freed_s"), 1000, 1), str(r["handed_back"]), f"{r['failed']}/{r['requests']}",
                     fmt(r["hop_added_gaps"], 1, 2), fmt(r.get("hop_net_gaps"), 1, 2), fmt(r.get("hop_target_gaps"), 1, 2),
                     "/".join(fmt(r["hop_ms"][k], 1000, 1) for k in HOP_PARTS) if r.get("hop_ms") else "-",
                     fmt(r["migrated_added_gaps"], 1, 2),
                     fmt(r["others_added_gaps"], 1, 2),
                     fmt(r["max_added_gaps"], 1, 2)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def cli_main(args: argparse.Namespace) -> int:
    try:
        report = run(args)
    except BenchError as exc:
        progress(f"bench switch: {exc}")
        return 1
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 1 if any(r["failed"] for r in report["switches"]) else 0
