"""The `triptych` command line. Each subcommand's work lives in the module that owns it;
this file only declares arguments and imports the owner lazily (so `triptych operator`
never imports torch, and `--help` is instant)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from triptych.topology import ROLE_CHOICES

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "llava")


def _lazy(target: str) -> Callable[[argparse.Namespace], int | None]:
    module_name, func_name = target.split(":")

    def run(args: argparse.Namespace) -> int | None:
        return getattr(importlib.import_module(module_name), func_name)(args)

    return run


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint (offline)")
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=("tiny", "small"), default="tiny",
                   help="tiny: tests (~1M params); small: benchmarks (a few tens of M params)")
    p.set_defaults(func=_lazy("triptych.tiny_model:cli_main"))


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run one request through the engine and print the completion")
    p.add_argument("--model", required=True, help="checkpoint directory, or 'tiny'")
    p.add_argument("--image", action="append", default=[], help="image path (repeatable)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_lazy("triptych.worker.generate:cli_main"))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    e = bsub.add_parser("engine", help="our engine vs transformers generate() on CPU")
    e.add_argument("--model", default=None, help="checkpoint dir (default: build the small Qwen2-VL)")
    e.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    e.add_argument("--output-len", type=int, default=32)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_lazy("triptych.bench.engine:cli_main"))
    s = bsub.add_parser("serve", help="Poisson load against a running router (or local topologies)")
    s.add_argument("--url", default=None, help="router base URL (or use --topologies)")
    s.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    s.add_argument("--num-requests", type=int, default=32)
    s.add_argument("--images-per-request", type=int, default=1)
    s.add_argument("--image-size", type=int, nargs=2, default=[64, 64])
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--output-len", type=int, default=16)
    s.add_argument("--ttft-slo", type=float, default=2.0)
    s.add_argument("--tbt-slo", type=float, default=0.2)
    s.add_argument("--plot", default=None, help="write attainment-vs-rate PNG here")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    s.add_argument("--out-json", default=None, help="also write the JSON report here")
    s.add_argument("--sweep", action="store_true", help="double from the first rate, then bisect: goodput")
    s.add_argument("--sweep-max-rate", type=float, default=64.0)
    s.add_argument("--sweep-steps", type=int, default=2, help="bisection steps after the first failing rate")
    s.add_argument("--attainment-target", type=float, default=0.9)
    s.add_argument("--request-timeout", type=float, default=120.0)
    s.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted")
    s.add_argument("--worker-urls", nargs="*", default=[], help="workers to scrape /metrics from")
    s.add_argument("--api-key", default=None)
    s.add_argument("--measure-nixl", action="store_true", help="also measure raw NIXL READ bandwidth")
    s.add_argument("--nixl-mib", type=int, default=64)
    s.add_argument("--topologies", default=None, help="e.g. EPD,1E1P1D,1EP1D: start each locally in turn")
    s.add_argument("--model", default="tiny", help="with --topologies: checkpoint directory, or 'tiny'")
    s.add_argument("--transfer-require", choices=("any", "nixl"), default="nixl")
    s.add_argument("--log-dir", default=None, help="with --topologies: process logs go here")
    s.add_argument("--idle-seconds", type=float, default=3.0,
                   help="with --topologies: measure idle CPU this long before the load (0: skip)")
    s.set_defaults(func=_lazy("triptych.bench.serve:cli_main"))
    i = bsub.add_parser("idle", help="CPU each process of an idle local deployment uses")
    i.add_argument("--topology", default="1E1P1D")
    i.add_argument("--seconds", type=float, default=20.0, help="length of the sampling window")
    i.add_argument("--settle", type=float, default=2.0, help="seconds to wait after ready before sampling")
    i.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    i.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_lazy("triptych.bench.idle_cpu:cli_main"))


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one engine instance (FastAPI)")
    p.add_argument("--model", required=True)
    p.add_argument("--role", choices=ROLE_CHOICES, default="unassigned")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--instance-id", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--num-mm-blocks", type=int, default=None)
    p.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--token-budget", type=int, default=None, help="tokens per step (default: from SLO or 2048)")
    p.add_argument("--image-budget", type=int, default=None, help="images encoded per step")
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds; budgets by start-up profiling")
    p.add_argument("--tbt-slo", type=float, default=None, help="seconds; budgets by start-up profiling")
    p.add_argument("--config", default=os.environ.get("TRIPTYCH_CONFIG"),
                   help="serving config file (the operator's ConfigMap; default $TRIPTYCH_CONFIG); "
                        "flags win over it")
    p.add_argument("--internal-token-file", default=None,
                   help="file holding the internal token (else TRIPTYCH_INTERNAL_TOKEN): /internal/* needs it")
    p.add_argument("--admin-token-file", default=None,
                   help="file holding the admin token (else TRIPTYCH_ADMIN_TOKEN): /admin/* needs it")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="start without an internal token: /internal and /admin open to anyone (local tests only)")
    p.set_defaults(func=_lazy("triptych.worker.server:cli_main"))


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the OpenAI-compatible router")
    p.add_argument("--model", required=True, help="checkpoint directory (tokenizer, processor)")
    p.add_argument("--workers", nargs="*", default=[], help="worker URLs (static discovery)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable; prefer --api-key-file or TRIPTYCH_API_KEY: argv is visible)")
    p.add_argument("--api-key-file", default=None, help="file with one API key per line")
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="serve a non-loopback --host without API keys (refused by default)")
    p.add_argument("--admin-token-file", default=None,
                   help="file holding the admin token (else TRIPTYCH_ADMIN_TOKEN): its holder sees every "
                        "instance on /health")
    p.add_argument("--internal-token-file", default=None,
                   help="file holding the token the router sends to workers (else TRIPTYCH_INTERNAL_TOKEN)")
    p.add_argument("--allow-http-images", action="store_true")
    p.add_argument("--image-host-allowlist", nargs="*", default=[],
                   help="hosts images may be fetched from: example.com, example.com:8080, *.example.com")
    p.add_argument("--allow-private-image-hosts", action="store_true",
                   help="let allow-listed hosts resolve to loopback/private/link-local addresses")
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                   help="static: --workers; kubernetes: watch the worker pods of --k8s-deployment")
    p.add_argument("--k8s-namespace", default=None, help="namespace of the worker pods (kubernetes discovery)")
    p.add_argument("--k8s-deployment", default=None, help="MLLMDeployment name (kubernetes discovery)")
    p.add_argument("--routing-policy", choices=("round-robin", "least-loaded", "power-of-two"),
                   default="round-robin", help="instance choice for every stage")
    p.add_argument("--stage-policy", action="append", default=[], metavar="STAGE=POLICY",
                   help="override the policy of one stage, e.g. encode=least-loaded (repeatable)")
    p.add_argument("--no-parallel-encode", action="store_true",
                   help="encode all of a request's images on one instance (no IRP)")
    p.add_argument("--no-cache-affinity", action="store_true",
                   help="do not send a known image to the instance that holds its embedding")
    p.add_argument("--max-inflight-requests", type=int, default=512,
                   help="over this many requests in flight, new ones get 429 with Retry-After")
    p.add_argument("--max-instance-load", type=float, default=None,
                   help="429 when every instance of a request's first stage reports more queued work")
    p.add_argument("--stage-timeout", type=float, default=60.0,
                   help="longest silence (s) allowed on a stage call before it counts as failed")
    p.add_argument("--max-images-per-request", type=int, default=None)
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds, for the SLO attainment metrics")
    p.add_argument("--tbt-slo", type=float, default=None, help="seconds, for the SLO attainment metrics")
    p.set_defaults(func=_lazy("triptych.router.main:cli_main"))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run router and instances as local processes")
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    p.add_argument("--topology", default="EPD")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    p.add_argument("--api-key-file", default=None, help="the router's API keys, one per line (or TRIPTYCH_API_KEY)")
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="serve a non-loopback --host without API keys (refused by default)")
    p.add_argument("--admin-token-file", default=None,
                   help="admin token for the children (else TRIPTYCH_ADMIN_TOKEN, else one is generated "
                        "into ~/.cache/triptych/admin-token, mode 0600)")
    p.set_defaults(func=_lazy("triptych.local:cli_main"))


def _add_operator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the kopf operator")
    p.add_argument("--namespace", action="append", default=[], help="restrict to namespace(s)")
    p.add_argument("--standalone", action="store_true", help="no peering")
    p.set_defaults(func=_lazy("triptych.operator.main:cli_main"))
    c = sub.add_parser("crd", help="print (or write) the MLLMDeployment CRD YAML")
    c.add_argument("--out", default=None)
    c.set_defaults(func=_lazy("triptych.operator.crd:cli_main"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triptych", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_make_tiny_model, _add_generate, _add_bench, _add_worker, _add_router,
                _add_serve, _add_operator):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
