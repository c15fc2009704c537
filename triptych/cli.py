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


def _cpus(text: str) -> float:
    """A CPU share: a positive number of CPUs (0.5 = half a core)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of CPUs, got {text}")
    return value


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
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="both systems' weights and KV (bfloat16 pays on CPUs with native bf16)")
    e.add_argument("--compile-decode", action="store_true", help="torch.compile our decode step")
    e.add_argument("--sections", nargs="+", default=["workloads", "multimodal", "text_only"],
                   choices=["workloads", "multimodal", "text_only"])
    e.add_argument("--workloads", nargs="+", default=["uniform", "longtail"], choices=["uniform", "longtail"])
    e.add_argument("--workload-requests", type=int, default=64)
    e.add_argument("--workload-concurrency", type=int, default=32)
    e.add_argument("--uniform-len", type=int, default=128)
    e.add_argument("--longtail-range", type=int, nargs=2, default=[8, 512], metavar=("MIN", "MAX"))
    e.add_argument("--longtail-median", type=float, default=64.0)
    e.add_argument("--longtail-sigma", type=float, default=1.0)
    e.add_argument("--arrival-rate", type=float, default=16.0, help="long-tailed arrivals per second (Poisson)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_lazy("triptych.bench.engine:cli_main"))
    _add_bench_throughput(bsub)
    s = bsub.add_parser("serve", help="Poisson load against a running router (or local topologies)")
    s.add_argument("--url", default=None, help="router base URL (or use --topologies)")
    s.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    s.add_argument("--num-requests", type=int, default=32)
    s.add_argument("--images-per-request", type=int, default=1)
    s.add_argument("--image-size", type=int, nargs=2, default=[64, 64])
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--output-len", type=int, default=16)
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this JSON-lines trace ({t, images, prompt_tokens, output_tokens} a line) "
                        "instead of the synthetic Poisson workload")
    s.add_argument("--trace-rates", type=float, nargs="+", default=None,
                   help="with --trace: re-time the trace to these mean rates (default: its own times)")
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
    s.add_argument("--instance-cpus", type=_cpus, default=None, metavar="X",
                   help="with --topologies: cap every instance at X CPUs (cgroup quota)")
    s.add_argument("--total-cpus", type=_cpus, default=None, metavar="T",
                   help="with --topologies: each topology gets T CPUs, split evenly over its instances")
    s.set_defaults(func=_lazy("triptych.bench.serve:cli_main"))
    n = bsub.add_parser("neighbours", help="an instance's decode throughput alone and with busy neighbours")
    n.add_argument("--instance-cpus", type=_cpus, required=True, metavar="X", help="CPU quota of every instance")
    n.add_argument("--neighbours", type=int, default=3, help="busy EPD instances beside the target")
    n.add_argument("--concurrency", type=int, default=4, help="streams per instance (closed loop)")
    n.add_argument("--output-len", type=int, default=64, help="tokens per request (ignore_eos)")
    n.add_argument("--seconds", type=float, default=20.0, help="length of each measurement window")
    n.add_argument("--ramp", type=float, default=3.0, help="seconds of neighbour load before measuring")
    n.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    n.add_argument("--request-timeout", type=float, default=120.0)
    n.add_argument("--priority", type=_cpus, default=1.0, metavar="K",
                   help="weight of each capped instance: K busy tasks per CPU of quota (K > 1: the quota, "
                        "not other load on a busy machine, bounds it; it takes CPU from other processes)")
    n.add_argument("--no-contrast", action="store_true", help="skip the run without quotas")
    n.add_argument("--json", action="store_true")
    n.set_defaults(func=_lazy("triptych.bench.neighbours:cli_main"))
    i = bsub.add_parser("idle", help="CPU each process of an idle local deployment uses")
    i.add_argument("--topology", default="1E1P1D")
    i.add_argument("--seconds", type=float, default=20.0, help="length of the sampling window")
    i.add_argument("--settle", type=float, default=2.0, help="seconds to wait after ready before sampling")
    i.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    i.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_lazy("triptych.bench.idle_cpu:cli_main"))
    _add_bench_simulate_validate(bsub)
    _add_bench_autoscale_shift(bsub)
    _add_bench_video(bsub)
    _add_bench_switch(bsub)


def _add_bench_switch(bsub: argparse._SubParsersAction) -> None:
    w = bsub.add_parser("switch", help="role switch times (POST /admin/role) idle and under streams")
    w.add_argument("--topology", default="2E2P2D")
    w.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    w.add_argument("--concurrency", type=int, default=16, help="streams running during each loaded switch")
    w.add_argument("--output-len", type=int, default=64, help="tokens per request (ignore_eos)")
    w.add_argument("--images", type=int, default=1, help="images per request")
    w.add_argument("--min-running", type=int, default=2,
                   help="a D->X switch waits until the instance runs this many decodes")
    w.add_argument("--switch-after", type=float, default=0.3, help="seconds into the load before other switches")
    w.add_argument("--settle", type=float, default=1.5, help="seconds between switches (router poll)")
    w.add_argument("--instance-cpus", type=_cpus, default=None, metavar="X", help="cap every instance at X CPUs")
    w.add_argument("--request-timeout", type=float, default=180.0)
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=_lazy("triptych.bench.switch:cli_main"))


def _add_bench_autoscale_shift(bsub: argparse._SubParsersAction) -> None:
    a = bsub.add_parser("autoscale-shift",
                        help="serve --autoscale vs static under a workload shift (SLO attainment, lost requests)")
    a.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    a.add_argument("--topology", default="2E1P1D")
    a.add_argument("--instance-cpus", type=_cpus, default=None, metavar="X",
                   help="CPU quota of every instance; default: 0.5 (text), 0.25 (outputs)")
    a.add_argument("--instance-cpu-period-ms", type=float, default=10.0, metavar="MS",
                   help="the quota's CFS period: short, so a capped instance is a uniformly slower device "
                        "rather than one that stalls most of each 100 ms (cpu_quota.py)")
    a.add_argument("--priority", type=_cpus, default=None, metavar="K",
                   help="weight of each capped instance per CPU of quota (see bench neighbours); "
                        "default: 1 (text), 16 (outputs)")
    a.add_argument("--rate", type=float, default=None, help="requests/s in both phases; default: 2 (text), "
                   "1.5 (outputs)")
    a.add_argument("--phase-seconds", type=float, default=None, help="length of each phase; default: 40 (text), "
                   "30 (outputs)")
    a.add_argument("--after-seconds", type=float, default=None,
                   help="length of the phase after the shift; default: --phase-seconds (text), 120 (outputs)")
    a.add_argument("--image-size", type=int, nargs=2, default=[224, 224])
    a.add_argument("--shift", choices=("text", "outputs"), default="text",
                   help="text: image requests -> long text-only prompts (prefill bottleneck); outputs: "
                   "EPDServe Table 6, the same requests with --before-output -> --after-output tokens "
                   "(decode bottleneck)")
    a.add_argument("--before-images", type=int, default=None, help="default: 2 (text), 1 (outputs)")
    a.add_argument("--before-prompt", type=int, default=32, help="text tokens before the shift")
    a.add_argument("--before-output", type=int, default=None, help="default: 16 (text), 50 (outputs)")
    a.add_argument("--after-images", type=int, default=None, help="default: 0 (text), --before-images (outputs)")
    a.add_argument("--after-prompt", type=int, default=None,
                   help="text tokens after the shift; default: 800 (text), --before-prompt (outputs)")
    a.add_argument("--after-output", type=int, default=None, help="default: 16 (text), 500 (outputs)")
    a.add_argument("--ttft-slo", type=float, default=1.0)
    a.add_argument("--tbt-slo", type=float, default=None, help="default: 0.2 (text), 0.05 (outputs)")
    a.add_argument("--interval", type=float, default=2.0, help="planner: seconds between decisions")
    a.add_argument("--sustain", type=int, default=2, help="planner: snapshots a trigger must hold")
    a.add_argument("--role-switch-cooldown", type=float, default=15.0)
    a.add_argument("--max-queue-per-instance", type=float, default=4.0)
    a.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    a.add_argument("--request-timeout", type=float, default=120.0)
    a.add_argument("--log-dir", default=None)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", action="store_true")
    a.add_argument("--out-json", default=None, help="also write the JSON report here")
    a.set_defaults(func=_lazy("triptych.bench.autoscale_shift:cli_main"))


def _add_bench_simulate_validate(bsub: argparse._SubParsersAction) -> None:
    v = bsub.add_parser("simulate-validate",
                        help="the planner's simulator vs measured local runs of the same trace (TTFT/TPOT error)")
    v.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny'")
    v.add_argument("--topologies", default="EPD,1EP1D,1E1P1D")
    v.add_argument("--rates", type=float, nargs="+", default=[1.0, 3.0])
    v.add_argument("--num-requests", type=int, default=16)
    v.add_argument("--images-per-request", type=int, default=1)
    v.add_argument("--image-size", type=int, nargs=2, default=[224, 224])
    v.add_argument("--prompt-tokens", type=int, default=32, help="text tokens per request")
    v.add_argument("--output-tokens", type=int, default=16)
    v.add_argument("--instance-cpus", type=_cpus, default=0.5, metavar="X", help="CPU quota of every instance")
    v.add_argument("--instance-cpu-period-ms", type=float, default=10.0, metavar="MS",
                   help="the quota's CFS period: short, so a capped instance is a uniformly slower device "
                        "rather than one that stalls most of each 100 ms (cpu_quota.py)")
    v.add_argument("--priority", type=_cpus, default=1.0, metavar="K",
                   help="weight of each capped instance per CPU of quota (see bench neighbours)")
    v.add_argument("--profile", default=None, help="a profile JSON (default: measure one at the quota)")
    v.add_argument("--save-profile", default=None, help="where the measured profile goes")
    v.add_argument("--fit-overheads", action=argparse.BooleanOptionalAction, default=True,
                   help="fit the fixed per-step and per-request costs from a lone request per topology")
    v.add_argument("--fit-request-work", action=argparse.BooleanOptionalAction, default=True,
                   help="with --fit-overheads: charge the instances' CPU per request, beyond their steps, "
                        "as busy time (else all of it is latency)")
    v.add_argument("--ttft-slo", type=float, default=2.0)
    v.add_argument("--tbt-slo", type=float, default=0.2)
    v.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    v.add_argument("--request-timeout", type=float, default=120.0)
    v.add_argument("--log-dir", default=None)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", action="store_true")
    v.add_argument("--out-json", default=None, help="also write the JSON report here")
    v.set_defaults(func=_lazy("triptych.bench.sim_validate:cli_main"))


def _add_bench_video(bsub: argparse._SubParsersAction) -> None:
    v = bsub.add_parser("video", help="time to sampled frames: sequential PyAV vs collaborative decoders")
    v.add_argument("--clip", default=None, help="a video file (default: generate a 720p 60 s H.264 clip)")
    v.add_argument("--width", type=int, default=1280)
    v.add_argument("--height", type=int, default=720)
    v.add_argument("--seconds", type=int, default=60)
    v.add_argument("--fps", type=int, default=30, help="frame rate of the generated clip")
    v.add_argument("--gop", type=int, default=60, help="keyframe interval of the generated clip (frames)")
    v.add_argument("--sample-fps", type=float, default=2.0)
    v.add_argument("--max-frames", type=int, default=768)
    v.add_argument("--decoders", type=int, nargs="+", default=None, help="k values (default: 1 2 cores)")
    v.add_argument("--repeats", type=int, default=3)
    v.add_argument("--v-instances", type=int, default=2,
                   help="V instances (worker --role V processes) for the serving-path row; 0: skip it")
    v.add_argument("--v-threads", type=int, default=1, help="decoder threads per V instance")
    v.add_argument("--model", default=None,
                   help="checkpoint whose processor config the V row patchifies with (default: tiny Qwen2-VL)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=_lazy("triptych.worker.video.bench:cli_main"))


def _add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one engine instance (FastAPI); --role V: a video decoder "
                                      "instance (no model weights)")
    p.add_argument("--model", required=True)
    p.add_argument("--role", choices=ROLE_CHOICES, default="unassigned")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--instance-id", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn automatic prefix caching off (on by default: prompts reuse cached KV blocks)")
    p.add_argument("--no-parallel-vision", action="store_true",
                   help="on a GPU, run a step's encodes after its language forward instead of beside it "
                        "on a second CUDA stream (HydraInfer §4.2); CPU workers always run them in turn")
    p.add_argument("--num-mm-blocks", type=int, default=None)
    p.add_argument("--transfer-require", choices=("any", "nixl"), default="any")
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile-decode", action="store_true",
                   help="torch.compile the LM's norms and SiLU gate (falls back to eager if compiling fails)")
    p.add_argument("--decode-threads", type=int, default=2,
                   help="image decode threads; on a V instance, its video decoder threads")
    p.add_argument("--video-decoder", choices=("auto", "pyav", "nvdec"), default="auto",
                   help="a V instance's video decoder: NVDEC where CUDA and PyNvVideoCodec are available, "
                        "else PyAV (auto); or force one")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--token-budget", type=int, default=None, help="tokens per step (default: from SLO or 2048)")
    p.add_argument("--image-budget", type=int, default=None, help="images encoded per step")
    p.add_argument("--encode-token-budget", type=int, default=None,
                   help="vision-encoder tokens encoded per step (UnifiedServe Alg. 3 alpha; default: no limit)")
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
    p.set_defaults(func=_lazy("triptych.worker.launch:cli_main"))


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
    p.add_argument("--no-prefix-routing", action="store_true",
                   help="choose the prefill instance by policy alone, not by where the prompt's prefix is cached")
    p.add_argument("--prefix-routing-weight", type=float, default=8.0,
                   help="queued requests a whole-prompt prefix-cache hit is worth when choosing the prefill "
                        "instance (0: ignore prefixes; large: always the holder)")
    p.add_argument("--prefix-routing-min-tokens", type=int, default=64,
                   help="cached prefixes shorter than this (a chat template's header) do not steer routing")
    p.add_argument("--max-inflight-requests", type=int, default=512,
                   help="over this many requests in flight, new ones get 429 with Retry-After")
    p.add_argument("--max-instance-load", type=float, default=None,
                   help="429 when every instance of a request's first stage reports more queued work")
    p.add_argument("--stage-timeout", type=float, default=60.0,
                   help="longest silence (s) allowed on a stage call before it counts as failed")
    p.add_argument("--max-images-per-request", type=int, default=None)
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds, for the SLO attainment metrics")
    p.add_argument("--tbt-slo", type=float, default=None, help="seconds, for the SLO attainment metrics")
    p.add_argument("--slo-attainment-target", type=float, default=None,
                   help="share of requests that should meet the SLO (exported as a metric; default 0.9)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the checkpoint's max_position_embeddings)")
    p.set_defaults(func=_lazy("triptych.router.main:cli_main"))


def _add_bench_throughput(bsub: argparse._SubParsersAction) -> None:
    t = bsub.add_parser("throughput", help="closed-loop text load against an OpenAI server (and the engine)")
    t.add_argument("--url", default=None, help="server base URL (Triptych router, vLLM, ...)")
    t.add_argument("--engine", default=None, metavar="MODEL",
                   help="also run the same requests through our engine in-process (checkpoint dir)")
    t.add_argument("--workload", choices=("uniform", "longtail", "both"), default="both")
    t.add_argument("--num-requests", type=int, default=64)
    t.add_argument("--concurrency", type=int, default=32)
    t.add_argument("--output-len", type=int, default=128, help="uniform: tokens per completion")
    t.add_argument("--min-len", type=int, default=8, help="longtail: shortest completion")
    t.add_argument("--max-len", type=int, default=512, help="longtail: longest completion")
    t.add_argument("--repeats", type=int, default=2, help="runs of each (in turns); the best is reported")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--api-key", default=None)
    t.add_argument("--request-timeout", type=float, default=600.0)
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_lazy("triptych.bench.throughput:cli_main"))


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
    p.add_argument("--instance-cpus", type=_cpus, default=None, metavar="X",
                   help="cap every instance at X CPUs (its own cgroup, ceil(X) torch threads); "
                        "without root or a cpu controller it says so and runs uncapped")
    p.add_argument("--instance-cpu-period-ms", type=float, default=None, metavar="MS",
                   help="with --instance-cpus: the quota's CFS period (default: the kernel's 100 ms; "
                        "a short one, e.g. 10, makes an instance a uniformly slower device)")
    p.add_argument("--autoscale", action="store_true", help="also run the planner (triptych autoscale)")
    p.add_argument("--planner-port", type=int, default=8090, help="with --autoscale: the planner's /metrics, /plan")
    p.add_argument("--autoscale-standby", type=int, default=0,
                   help="with --autoscale: extra unassigned instances encoder scaling can take")
    p.add_argument("--autoscale-video-standby", type=int, default=0,
                   help="with --autoscale: extra V processes, started parked, V scaling can take")
    p.add_argument("--autoscale-args", default="", help="with --autoscale: more `triptych autoscale` flags")
    p.add_argument("--admin-token-file", default=None,
                   help="admin token for the children (else TRIPTYCH_ADMIN_TOKEN, else one is generated "
                        "into ~/.cache/triptych/admin-token, mode 0600)")
    p.set_defaults(func=_lazy("triptych.local:cli_main"))


def _add_autoscale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autoscale", help="the planner beside a local deployment (docs/planner.md)")
    p.add_argument("--router", required=True, help="router base URL")
    p.add_argument("--admin-token-file", default=None, help="the router's admin token")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090, help="/metrics and /plan")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between decisions")
    p.add_argument("--dry-run", action="store_true", help="decide and record, change nothing")
    p.add_argument("--limit", action="append", default=[], metavar="TYPE=MIN:MAX", help="e.g. E=1:4")
    p.add_argument("--no-role-switching", action="store_true")
    p.add_argument("--no-encoder-scaling", action="store_true")
    p.add_argument("--sustain", type=int, default=3, help="snapshots a trigger must hold")
    p.add_argument("--max-queue-per-instance", type=float, default=16.0)
    p.add_argument("--divergence-on", type=float, default=0.5)
    p.add_argument("--divergence-off", type=float, default=0.25)
    p.add_argument("--encode-up", type=float, default=8.0, help="queued images per E that add one")
    p.add_argument("--encode-down", type=float, default=1.0, help="queued images per E that remove one")
    p.add_argument("--no-decode-scaling", action="store_true", help="never lend an instance to D on decode pressure")
    p.add_argument("--decode-up", type=float, default=1.0, help="TBT p90 / --slo-tbt at which decode is under pressure")
    p.add_argument("--decode-down", type=float, default=0.5,
                   help="TBT p90 / --slo-tbt (with one D fewer) under which a lent instance goes back")
    p.add_argument("--no-video-scaling", action="store_true")
    p.add_argument("--video-up", type=float, default=8.0, help="queued GOP sets per V that add one")
    p.add_argument("--video-down", type=float, default=0.5, help="queued GOP sets per V that remove one")
    p.add_argument("--scale-up-cooldown", type=float, default=60.0)
    p.add_argument("--scale-down-cooldown", type=float, default=300.0)
    p.add_argument("--role-switch-cooldown", type=float, default=120.0)
    p.add_argument("--replan-interval", type=float, default=300.0)
    p.add_argument("--replan-gain", type=float, default=1.1)
    p.add_argument("--profile", default=None, help="step-time profile JSON: enables replans")
    p.add_argument("--gpu", default=None, choices=("H100", "H200", "A100", "L40S"),
                   help="replan on a roofline profile (needs --model)")
    p.add_argument("--model", default=None, help="with --gpu: the model directory")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tbt", type=float, default=0.2)
    p.set_defaults(func=_lazy("triptych.operator.planner.local_main:cli_main"))


def _add_operator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the kopf operator")
    p.add_argument("--namespace", action="append", default=[], help="restrict to namespace(s)")
    p.add_argument("--standalone", action="store_true", help="no peering: the only replica (the default)")
    p.add_argument("--peering", default=None, metavar="NAME",
                   help="kopf peering object NAME: of several replicas only one acts (the oldest)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; the highest live one acts (default: older start = higher)")
    p.set_defaults(func=_lazy("triptych.operator.main:cli_main"))
    c = sub.add_parser("crd", help="print (or write) the MLLMDeployment CRD YAML")
    c.add_argument("--out", default=None)
    c.set_defaults(func=_lazy("triptych.operator.crd:cli_main"))


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """A synthetic workload (planner/workload.py): Poisson arrivals, lognormal lengths."""
    p.add_argument("--rate", type=float, default=None, help="requests/s (re-times a --workload trace)")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--image-size", type=int, nargs=2, default=[448, 448], metavar=("W", "H"))
    p.add_argument("--prompt-tokens", type=int, default=64, help="median text tokens")
    p.add_argument("--prompt-sigma", type=float, default=0.0, help="lognormal sigma (0: fixed)")
    p.add_argument("--output-tokens", type=int, default=64, help="median output tokens")
    p.add_argument("--output-sigma", type=float, default=0.0, help="lognormal sigma (0: fixed)")
    p.add_argument("--max-tokens", type=int, default=8192, help="clip sampled lengths here")
    p.add_argument("--seed", type=int, default=0)


def _add_planner_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (only its config.json is read)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", default=None, help="step-time profile JSON (triptych profile)")
    src.add_argument("--gpu", default=None, choices=("H100", "H200", "A100", "L40S"),
                     help="roofline stand-in for a measured profile")
    p.add_argument("--workload", default=None, help="JSON-lines trace (else a synthetic workload)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tbt", type=float, default=0.2, help="seconds")
    p.add_argument("--routing", choices=("round-robin", "least-loaded"), default="round-robin")
    p.add_argument("--json", action="store_true")
    _add_workload_args(p)


def _add_planner(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="simulate a topology under a workload (discrete-event)")
    _add_planner_common(s)
    s.add_argument("--topology", required=True, help="e.g. 1E1P1D, 2EP1D, EPD")
    s.add_argument("--rates", type=float, nargs="*", default=[], help="run the workload at each rate")
    s.add_argument("--goodput", action="store_true", help="also search the goodput")
    s.set_defaults(func=_lazy("triptych.operator.planner.cli:simulate_main"))
    p = sub.add_parser("plan", help="best hybrid method and instance ratio for N instances (simulated)")
    _add_planner_common(p)
    p.add_argument("--instances", type=int, required=True)
    p.add_argument("--methods", nargs="*", default=None, help="subset of E+P+D EP+D ED+P E+PD EPD")
    p.add_argument("--keep-per-method", type=int, default=2, help="ratios per method simulated")
    p.set_defaults(func=_lazy("triptych.operator.planner.cli:plan_main"))
    w = sub.add_parser("workload", help="write a synthetic JSON-lines workload trace")
    w.add_argument("--out", required=True)
    _add_workload_args(w)
    w.set_defaults(func=_lazy("triptych.operator.planner.cli:workload_main"))


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure step-time tables on this device (for simulate/plan)")
    p.add_argument("--model", required=True, help="checkpoint directory, or 'tiny'")
    p.add_argument("--out", required=True, help="profile JSON")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--migration-bytes-per-s", type=float, default=None,
                   help="measured transfer bandwidth (default: an in-memory copy here)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024], help="prefill sizes")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="decode batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 256, 1024], help="decode context lengths")
    p.set_defaults(func=_lazy("triptych.worker.step_profile:cli_main"))


def _add_dashboards(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON) into a directory")
    p.add_argument("--out", required=True, help="e.g. deploy/dashboards")
    p.set_defaults(func=_lazy("triptych.dashboards:cli_main"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triptych", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_make_tiny_model, _add_generate, _add_bench, _add_worker, _add_router,
                _add_serve, _add_autoscale, _add_operator, _add_planner, _add_profile, _add_dashboards):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
