"""The `triptych` command line. Each subcommand's work lives in the module that owns it;
this file only declares arguments and imports the owner lazily (so `triptych operator`
never imports torch, and `--help` is instant). The bench, serving and planner subcommands
declare theirs in cli_bench.py, cli_serving.py and cli_planner.py; options several of them
take are defined once in cli_args.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from triptych.cli_args import add_device, add_dtype, add_model, add_seed, lazy
from triptych.cli_bench import add_bench
from triptych.cli_planner import add_planner, add_profile
from triptych.cli_serving import add_autoscale, add_router, add_serve, add_worker

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "llava")


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint (offline)")
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    add_seed(p)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny",
                   help="tiny: tests (~1M params); small: benchmarks (a few tens of M params)")
    p.set_defaults(func=lazy("triptych.tiny_model:cli_main"))


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run one request through the engine and print the completion")
    add_model(p, None, required=True)
    p.add_argument("--image", action="append", default=[], help="image path (repeatable)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_seed(p, None)
    add_dtype(p)
    add_device(p)
    p.set_defaults(func=lazy("triptych.worker.generate:cli_main"))


def _add_operator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the kopf operator")
    p.add_argument("--namespace", action="append", default=[], help="restrict to namespace(s)")
    p.add_argument("--standalone", action="store_true", help="no peering: the only replica (the default)")
    p.add_argument("--peering", default=None, metavar="NAME",
                   help="kopf peering object NAME: of several replicas only one acts (the oldest)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; the highest live one acts (default: older start = higher)")
    p.set_defaults(func=lazy("triptych.operator.main:cli_main"))
    c = sub.add_parser("crd", help="print (or write) the MLLMDeployment CRD YAML")
    c.add_argument("--out", default=None)
    c.set_defaults(func=lazy("triptych.operator.crd:cli_main"))


def _add_dashboards(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON) into a directory")
    p.add_argument("--out", required=True, help="e.g. deploy/dashboards")
    p.set_defaults(func=lazy("triptych.dashboards:cli_main"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triptych", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_make_tiny_model, _add_generate, add_bench, add_worker, add_router,
                add_serve, add_autoscale, _add_operator, add_planner, add_profile, _add_dashboards):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
