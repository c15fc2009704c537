"""Grafana dashboards as code: `triptych dashboards --out DIR` writes the JSON that ships under
deploy/dashboards/ and in the Helm chart (tests keep all three in sync and run every query
against a real Prometheus scraping a loaded local deployment).

Metric names follow docs/architecture.md ("Metrics"). Worker series carry their own
`instance` label (the instance id); a scrape without honor_labels renames it to
`exported_instance`, so per-instance panels group and label by both and work either way.
Every selector carries `namespace=~"$namespace"`: a regex that matches the empty string also
matches series without the label (local mode has no namespace).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

NS = 'namespace=~"$namespace"'
FRONT = f'{NS}, model=~"$model"'
WINDOW = "$window"
PER_INSTANCE = "instance, exported_instance, role"
INSTANCE_LEGEND = "{{role}} {{exported_instance}}{{instance}}"
SLO_TARGET = 0.9  # HydraInfer §2.3: goodput is the highest rate with attainment >= 90%


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | state-timeline
    stacked: bool = False
    thresholds: tuple[tuple[float, str], ...] = ()  # (from value, colour); the first is the base
    width: int = 12
    # Why this panel's queries may return no data yet (the data test exempts only these).
    no_data_reason: str | None = None


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...] = field(default=())

    @property
    def panels(self) -> list[Panel]:
        return [p for _, panels in self.rows for p in panels]


def _quantiles(metric: str, by: str, legend: str, where: str = FRONT) -> tuple[Query, ...]:
    return tuple(
        Query(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{where}}}[{WINDOW}])))",
              f"p{int(q * 100)} {legend}")
        for q in (0.5, 0.9, 0.99))


def _mean(metric: str, match: str) -> str:
    sel = f"{{{NS}, {match}}}"
    return f"sum(rate({metric}_sum{sel}[{WINDOW}])) / sum(rate({metric}_count{sel}[{WINDOW}]))"


# The request path in order (HydraInfer's latency breakdown): queue and exec of each stage,
# with the two migrations between them.
STAGE_BREAKDOWN = (
    Query(_mean("triptych_worker_stage_seconds", 'stage="encode", phase="queue"'), "encode queue"),
    Query(_mean("triptych_worker_stage_seconds", 'stage="encode", phase="exec"'), "encode exec"),
    Query(_mean("triptych_worker_migration_seconds", 'kind="ep"'), "E->P migration"),
    Query(_mean("triptych_worker_stage_seconds", 'stage="prefill", phase="queue"'), "prefill queue"),
    Query(_mean("triptych_worker_stage_seconds", 'stage="prefill", phase="exec"'), "prefill exec"),
    Query(_mean("triptych_worker_migration_seconds", 'kind="pd"'), "P->D migration"),
    Query(_mean("triptych_worker_stage_seconds", 'stage="decode", phase="queue"'), "decode queue"),
    Query(_mean("triptych_worker_stage_seconds", 'stage="decode", phase="exec"'), "decode exec"),
)

SLO_EXPR = (f'sum by (namespace, model) (rate(triptych_frontend_slo_requests_total{{{FRONT}, result="met"}}[{WINDOW}]))'
            f" / sum by (namespace, model) (rate(triptych_frontend_slo_requests_total{{{FRONT}}}[{WINDOW}]))")
GOODPUT_EXPR = (f'sum by (namespace, model) '
                f'(rate(triptych_frontend_slo_requests_total{{{FRONT}, result="met"}}[{WINDOW}]))')
FALLBACK_BYTES_EXPR = (f'sum(rate(triptych_worker_transfer_bytes_total{{{NS}, transport!~"nixl-.*"}}[{WINDOW}]))'
                       " or vector(0)")

SLO = Dashboard(
    uid="triptych-slo",
    title="Triptych / SLO and latency",
    description="SLO attainment, goodput, token latencies and the per-stage latency breakdown.",
    rows=(
        ("SLO", (
            Panel("SLO attainment per deployment",
                  "Share of finished requests that met the SLO (HydraInfer §2.3: TTFT <= TTFT SLO and 90% of "
                  f"token gaps <= TBT SLO) over $window. The dashed line is the {SLO_TARGET:.0%} target.",
                  (Query(SLO_EXPR, "{{namespace}} {{model}}"),
                   Query(f"max by (namespace, model) (triptych_frontend_slo_attainment{{{FRONT}}})",
                         "since start {{namespace}} {{model}}")),
                  unit="percentunit", thresholds=((0.0, "red"), (SLO_TARGET, "green"))),
            Panel("Goodput per deployment",
                  "Requests per second that met the SLO, beside all finished requests. `triptych bench serve "
                  "--sweep` measures goodput as the highest rate with attainment >= 90%.",
                  (Query(GOODPUT_EXPR, "meeting SLO {{namespace}} {{model}}"),
                   Query(f"sum by (namespace, model) (rate(triptych_frontend_requests_total{{{FRONT}}}[{WINDOW}]))",
                         "all {{namespace}} {{model}}")),
                  unit="reqps"),
        )),
        ("Token latency", (
            Panel("Time to first token", "TTFT percentiles at the router.",
                  _quantiles("triptych_frontend_time_to_first_token_seconds", "model", "{{model}}"),
                  unit="s", width=8),
            Panel("Time between tokens", "TBT (inter-token gap) percentiles at the router.",
                  _quantiles("triptych_frontend_time_between_tokens_seconds", "model", "{{model}}"),
                  unit="s", width=8),
            Panel("End-to-end latency", "Request arrival to last token.",
                  _quantiles("triptych_frontend_e2e_request_latency_seconds", "model", "{{model}}"),
                  unit="s", width=8),
        )),
        ("Where the time goes", (
            Panel("Per-stage latency breakdown (mean, stacked)",
                  "Mean seconds per request in each stage, in path order: encode, E->P migration, prefill, "
                  "P->D migration, decode; queue and exec separately.",
                  STAGE_BREAKDOWN, unit="s", stacked=True, width=16),
            Panel("Requests by status",
                  "Finished API requests per second by HTTP status, and requests in flight.",
                  (Query(f"sum by (status) (rate(triptych_frontend_requests_total{{{FRONT}}}[{WINDOW}]))",
                         "{{status}}"),
                   Query(f"sum(triptych_frontend_requests_in_flight{{{FRONT}}})", "in flight")),
                  unit="reqps", width=8),
        )),
    ),
)

INSTANCES = Dashboard(
    uid="triptych-instances",
    title="Triptych / Instances and transfers",
    description="Queued work, cache use and roles per instance; NIXL transfers; planner decisions.",
    rows=(
        ("Instances", (
            Panel("Queued and running requests per instance",
                  "The scheduler's waiting and running requests on each instance.",
                  (Query(f"sum by ({PER_INSTANCE}, state) (triptych_worker_requests{{{NS}, state=~\"waiting|running\"}})",
                         INSTANCE_LEGEND + " {{state}}"),)),
            Panel("Cache use per instance",
                  "Used share of the paged KV cache and MM (embedding) cache blocks.",
                  (Query(f"sum by ({PER_INSTANCE}, cache) (triptych_worker_cache_blocks{{{NS}, state=\"used\"}}) / "
                         f"sum by ({PER_INSTANCE}, cache) (triptych_worker_cache_blocks{{{NS}, state=~\"used|free\"}})",
                         INSTANCE_LEGEND + " {{cache}}"),),
                  unit="percentunit"),
            Panel("Instances by role",
                  "How many instances serve each instance type (E, P, D, EP, ...) over time; role switches "
                  "show as one band shrinking while another grows.",
                  (Query(f"count by (role) (triptych_worker_leases_outstanding{{{NS}}})", "{{role}}"),),
                  stacked=True),
            Panel("Instance roles over time", "Each instance's current role, as the router sees it.",
                  (Query(f"max by ({PER_INSTANCE}) (triptych_frontend_instance_ready{{{NS}}})", INSTANCE_LEGEND),),
                  kind="state-timeline"),
        )),
        ("Transfers", (
            Panel("Transfer bandwidth by transport",
                  "Bytes per second moved between instances, by transport and region (kv, mm).",
                  (Query(f"sum by (transport, region) (rate(triptych_worker_transfer_bytes_total{{{NS}}}[{WINDOW}]))",
                         "{{transport}} {{region}}"),),
                  unit="Bps"),
            Panel("Transfer latency by transport", "p50/p99 of one block READ batch.",
                  _quantiles("triptych_worker_transfer_seconds", "transport", "{{transport}}", NS)[::2],
                  unit="s"),
            Panel("FALLBACK transport in use",
                  "Bytes per second moved by a transport other than NIXL (e.g. the TCP fallback). Must be 0: "
                  "anything else means an instance could not use NIXL and is slower than planned.",
                  (Query(FALLBACK_BYTES_EXPR, "fallback bytes/s"),),
                  unit="Bps", kind="stat", thresholds=((0.0, "green"), (1e-9, "red")), width=6),
            Panel("Transfer failures", "Failed transfers per second (should be 0).",
                  (Query(f"sum(rate(triptych_worker_transfer_failures_total{{{NS}}}[{WINDOW}])) or vector(0)",
                         "failures/s"),),
                  kind="stat", thresholds=((0.0, "green"), (1e-9, "red")), width=6),
            Panel("Migration time by kind and transport", "p90 of E->P (ep) and P->D (pd) pulls.",
                  (Query(f"histogram_quantile(0.9, sum by (le, kind, transport) "
                         f"(rate(triptych_worker_migration_seconds_bucket{{{NS}}}[{WINDOW}])))",
                         "p90 {{kind}} {{transport}}"),)),
        )),
        ("Planner", (
            Panel("Planner decisions",
                  "Decisions of the planner/autoscaler (role switches, scaling, replans) by action.",
                  (Query(f"sum by (action) (increase(triptych_planner_decisions_total{{{NS}}}[{WINDOW}]))",
                         "{{action}}"),),
                  stacked=True, width=24,
                  no_data_reason="the planner does not export triptych_planner_* metrics yet; the panel "
                                 "is in place for them"),
        )),
    ),
)

DASHBOARDS = (SLO, INSTANCES)


def _variables() -> list[dict]:
    def query_var(name: str, metric: str) -> dict:
        return {"name": name, "label": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": f"label_values({metric}, {name})", "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "definition": f"label_values({metric}, {name})", "refresh": 2, "includeAll": True, "multi": True,
                "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}

    window = {"name": "window", "label": "window", "type": "interval", "query": "1m,5m,15m,1h",
              "current": {"text": "5m", "value": "5m"}, "options": [], "auto": False}
    datasource = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                  "current": {}, "hide": 0}
    return [datasource, query_var("namespace", "triptych_frontend_requests_total"),
            query_var("model", "triptych_frontend_requests_total"), window]


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    # The first threshold is the base colour (Grafana's value null); the others start at their value.
    base = panel.thresholds[0][1] if panel.thresholds else "green"
    steps = [{"color": base, "value": None}] + [{"color": c, "value": v} for v, c in panel.thresholds[1:]]
    custom: dict = {}
    if panel.kind == "timeseries":
        custom = {"drawStyle": "line", "fillOpacity": 30 if panel.stacked else 10, "showPoints": "never",
                  "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"}}
        if panel.thresholds:
            custom["thresholdsStyle"] = {"mode": "dashed"}
    options: dict = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                     "tooltip": {"mode": "multi", "sort": "desc"}}
    if panel.kind == "stat":
        options = {"colorMode": "background", "graphMode": "area", "reduceOptions": {"calcs": ["lastNotNull"]}}
    return {
        "id": pid, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom,
                                     "thresholds": {"mode": "absolute", "steps": steps}}, "overrides": []},
        "options": options,
        "targets": [{"refId": chr(ord("A") + i), "expr": q.expr, "legendFormat": q.legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, q in enumerate(panel.queries)],
    }


def render(dashboard: Dashboard) -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for row_title, row_panels in dashboard.rows:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, pid, x, y))
            pid, x = pid + 1, x + panel.width
        y += 8
    return {
        "uid": dashboard.uid, "title": dashboard.title, "description": dashboard.description,
        "tags": ["triptych"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "templating": {"list": _variables()}, "annotations": {"list": []}, "links": [], "panels": panels,
    }


def render_all() -> dict[str, str]:
    """File name -> JSON text, byte-stable (tests compare checked-in copies with it)."""
    return {f"{d.uid}.json": json.dumps(render(d), indent=2, sort_keys=True) + "\n" for d in DASHBOARDS}


def write_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


def cli_main(args: argparse.Namespace) -> int:
    for path in write_all(Path(args.out)):
        print(path)
    return 0
