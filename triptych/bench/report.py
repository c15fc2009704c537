"""Tables, the text report and the attainment plot of the serving benchmark."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from triptych.bench.stats import ATTAINMENT_TARGET, TBT_FRACTION, goodput


def progress(msg: str) -> None:
    """Progress goes to stderr: stdout holds only the report (or its JSON)."""
    print(msg, file=sys.stderr, flush=True)


def fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v * scale:.{digits}f}"
    return str(v)


def rate_line(r: dict[str, Any]) -> str:
    return (f"attainment {fmt(r['slo_attainment'], 100, 1)}%  ok {r['completed']}/{r['num_requests']}  "
            f"TTFT p50/p99 {fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])} s  "
            f"TPOT p50/p99 {fmt(r['tpot_p50_s'], 1e3, 1)}/{fmt(r['tpot_p99_s'], 1e3, 1)} ms  "
            f"{fmt(r['throughput_rps'], 1, 2)} req/s")


RATE_COLUMNS = (
    ("rate", "rate", 1, 2), ("ok", "completed", 1, 0), ("attain%", "slo_attainment", 100, 1),
    ("ttft50", "ttft_p50_s", 1, 3), ("ttft90", "ttft_p90_s", 1, 3), ("ttft99", "ttft_p99_s", 1, 3),
    ("tpot50ms", "tpot_p50_s", 1e3, 1), ("tpot90ms", "tpot_p90_s", 1e3, 1), ("tpot99ms", "tpot_p99_s", 1e3, 1),
    ("e2e50", "e2e_p50_s", 1, 3), ("e2e99", "e2e_p99_s", 1, 3), ("req/s", "throughput_rps", 1, 2),
    ("tok/s", "output_tokens_per_s", 1, 1), ("ep50ms", "ep_migration_p50_s", 1e3, 2),
    ("ep95ms", "ep_migration_p95_s", 1e3, 2), ("pd50ms", "pd_migration_p50_s", 1e3, 2),
    ("pd95ms", "pd_migration_p95_s", 1e3, 2), ("MiB", "transfer_bytes_total", 2**-20, 2),
)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, float, int]],
          label: tuple[str, str] | None = None) -> str:
    cols = ([(label[0], label[1], 1.0, 0)] if label else []) + list(columns)
    cells = [[h for h, *_ in cols]]
    for row in rows:
        line = []
        for _, key, scale, digits in cols:
            v = row.get(key)
            line.append(fmt(float(v) if isinstance(v, int) and scale != 1 else v, scale, digits))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in cells)


def format_report(rep: dict[str, Any]) -> str:
    slo = rep["slo"]
    lines = [f"model {rep['model']} at {rep['url']}; workers scraped: {len(rep['workers'])}",
             f"SLO: TTFT <= {slo['ttft_s']} s, {TBT_FRACTION:.0%} of token gaps <= {slo['tbt_s']} s "
             f"(HydraInfer §2.3); times in s unless ms", "",
             table(rep["rates"], RATE_COLUMNS), ""]
    gp = rep["goodput_rps"]
    lines.append(f"goodput (highest rate with attainment >= {slo['target']:.0%}): "
                 + ("none" if gp is None else f"{gp:g} req/s" + (" (lower bound)" if rep["goodput_is_lower_bound"]
                                                                else "")))
    lines.append(f"all rates: attainment {fmt(rep['slo_attainment'], 100, 1)}%, "
                 f"EP migration p50/p95 {fmt(rep['ep_migration_p50_s'], 1e3, 2)}/"
                 f"{fmt(rep['ep_migration_p95_s'], 1e3, 2)} ms ({rep['ep_migrations']}), "
                 f"PD migration p50/p95 {fmt(rep['pd_migration_p50_s'], 1e3, 2)}/"
                 f"{fmt(rep['pd_migration_p95_s'], 1e3, 2)} ms ({rep['pd_migrations']}), "
                 f"transports {rep['migration_transports'] or '-'} ({rep.get('timings_source', 'histogram')}); "
                 f"router overhead p50 {fmt(rep.get('router_overhead_p50_s'), 1e3, 2)} ms")
    for key, nbytes in rep["transfer_bytes"].items():
        lines.append(f"  moved {nbytes / 2**20:.2f} MiB ({key})")
    if "nixl_read_gib_s" in rep:
        lines.append(f"raw NIXL READ bandwidth: {fmt(rep['nixl_read_gib_s'], 1, 2)} GiB/s "
                     f"({rep.get('nixl_read_error') or str(rep['nixl_read_mib']) + ' MiB reads'})")
    return "\n".join(lines)


def plot_attainment(series: dict[str, Sequence[tuple[float, float | None]]], path: Path,
                    target: float = ATTAINMENT_TARGET) -> None:
    """Attainment vs request rate, one line per series, the target as a dashed line and
    each series' goodput as a dotted vertical (HydraInfer Fig. 10 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":")]  # series that coincide stay visible
    for i, (label, points) in enumerate(series.items()):
        pts = sorted((r, a) for r, a in points if a is not None)
        marker, style = styles[i % len(styles)]
        line, = ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], marker=marker, linestyle=style,
                        markersize=7 - i % len(styles), label=label)
        gp = goodput(pts, target)
        if gp is not None:
            ax.axvline(gp, color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(target * 100, color="gray", linestyle="--", linewidth=1, label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


TOPOLOGY_COLUMNS = (
    ("goodput", "goodput_rps", 1, 2), ("attain%", "slo_attainment", 100, 1), ("ok", "completed", 1, 0),
    ("ttft50", "ttft_p50_s", 1, 3), ("ttft99", "ttft_p99_s", 1, 3), ("tpot50ms", "tpot_p50_s", 1e3, 1),
    ("tpot99ms", "tpot_p99_s", 1e3, 1), ("e2e50", "e2e_p50_s", 1, 3), ("req/s", "throughput_rps", 1, 2),
    ("ep95ms", "ep_migration_p95_s", 1e3, 2), ("pd95ms", "pd_migration_p95_s", 1e3, 2),
    ("rtr50ms", "router_overhead_p50_s", 1e3, 2), ("MiB", "transfer_bytes_total", 2**-20, 2),
    ("idleCPU", "idle_cpu_cores", 1, 2),
)
