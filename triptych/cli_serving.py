"""The serving processes' subcommands: `triptych worker`, `router`, `serve` (both as local
processes) and `autoscale` (the planner beside them). Arguments only; the work lives in
worker/launch.py, router/main.py, local.py and operator/planner/local_main.py."""

from __future__ import annotations

import argparse
import os

from triptych.cli_args import (
    add_admin_token_file,
    add_allow_no_api_key,
    add_compile_decode,
    add_cpu_binding,
    add_cpu_period,
    add_device,
    add_dtype,
    add_gpu,
    add_inherited_socket,
    add_instance_cpus,
    add_internal_token_file,
    add_listen,
    add_max_model_len,
    add_model,
    add_no_stage_channel,
    add_planner_slos,
    add_serving_dtype,
    add_slos,
    add_stream_interval,
    add_threads,
    add_topology,
    add_transfer_require,
    cpu_list,
    lazy,
)
from triptych.topology import ROLE_CHOICES


def add_worker(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one engine instance (FastAPI); --role V: a video decoder "
                                      "instance (no model weights)")
    add_model(p, None, None, required=True)
    p.add_argument("--role", choices=ROLE_CHOICES, default="unassigned")
    add_listen(p, 8100)
    add_inherited_socket(p)
    p.add_argument("--instance-id", default=None)
    add_dtype(p)
    add_device(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn automatic prefix caching off (on by default: prompts reuse cached KV blocks)")
    p.add_argument("--no-parallel-vision", action="store_true",
                   help="on a GPU, run a step's encodes after its language forward instead of beside it "
                        "on a second CUDA stream (HydraInfer §4.2); CPU workers always run them in turn")
    p.add_argument("--num-mm-blocks", type=int, default=None)
    add_transfer_require(p)
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--precopy-timeout", type=float, default=0.25,
                   help="a switch or drain moving decodes lets them run this long while their new instances "
                        "pre-copy their full KV blocks (live migration); 0: move them whole at once")
    p.add_argument("--no-live-switch", action="store_true",
                   help="a P <-> D or D/P -> E switch answers only after its decodes moved out (the reply then "
                        "times the whole migration), instead of as soon as the new role runs")
    p.add_argument("--no-live-handover", action="store_true",
                   help="a greedy or seeded decode moving out (switch, drain) parks at once, instead of "
                        "decoding on here until its new instance takes over (make-before-break)")
    add_threads(p)
    add_stream_interval(p)
    p.add_argument("--engine-cpus", type=cpu_list, default=None, metavar="LIST",
                   help="run the engine's step thread (and its OpenMP threads) on these CPUs, e.g. 1 or 2-3")
    p.add_argument("--service-cpus", type=cpu_list, default=None, metavar="LIST",
                   help="run the worker's other threads (event loop, image decode, transfers) on these CPUs")
    add_compile_decode(p, "torch.compile the LM's norms and SiLU gate (falls back to eager if compiling fails)")
    p.add_argument("--decode-threads", type=int, default=2,
                   help="image decode threads; on a V instance, its video decoder threads")
    p.add_argument("--video-decoder", choices=("auto", "pyav", "nvdec"), default="auto",
                   help="a V instance's video decoder: NVDEC where CUDA and PyNvVideoCodec are available, "
                        "else PyAV (auto); or force one")
    add_max_model_len(p)
    p.add_argument("--token-budget", type=int, default=None, help="tokens per step (default: from SLO or 2048)")
    p.add_argument("--image-budget", type=int, default=None, help="images encoded per step")
    p.add_argument("--encode-token-budget", type=int, default=None,
                   help="vision-encoder tokens encoded per step (UnifiedServe Alg. 3 alpha; default: no limit)")
    add_slos(p, None, None, "seconds; budgets by start-up profiling")
    p.add_argument("--config", default=os.environ.get("TRIPTYCH_CONFIG"),
                   help="serving config file (the operator's ConfigMap; default $TRIPTYCH_CONFIG); "
                        "flags win over it")
    add_internal_token_file(p, "file holding the internal token (else TRIPTYCH_INTERNAL_TOKEN): "
                               "/internal/* needs it")
    add_admin_token_file(p, "file holding the admin token (else TRIPTYCH_ADMIN_TOKEN): /admin/* needs it")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="start without an internal token: /internal and /admin open to anyone (local tests only)")
    p.set_defaults(func=lazy("triptych.worker.launch:cli_main"))


def add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the OpenAI-compatible router")
    add_model(p, None, "checkpoint directory (tokenizer, processor)", required=True)
    p.add_argument("--workers", nargs="*", default=[], help="worker URLs (static discovery)")
    add_listen(p, 8000)
    add_inherited_socket(p)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable; prefer --api-key-file or TRIPTYCH_API_KEY: argv is visible)")
    p.add_argument("--api-key-file", default=None, help="file with one API key per line")
    add_allow_no_api_key(p)
    add_admin_token_file(p, "file holding the admin token (else TRIPTYCH_ADMIN_TOKEN): its holder sees every "
                            "instance on /health")
    add_internal_token_file(p, "file holding the token the router sends to workers (else TRIPTYCH_INTERNAL_TOKEN)")
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
    add_no_stage_channel(p)
    p.add_argument("--stage-timeout", type=float, default=60.0,
                   help="longest silence (s) allowed on a stage call before it counts as failed")
    p.add_argument("--max-images-per-request", type=int, default=None)
    add_slos(p, None, None, "seconds, for the SLO attainment metrics")
    p.add_argument("--slo-attainment-target", type=float, default=None,
                   help="share of requests that should meet the SLO (exported as a metric; default 0.9)")
    add_max_model_len(p, "context limit in tokens (default: the checkpoint's max_position_embeddings)")
    p.set_defaults(func=lazy("triptych.router.main:cli_main"))


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run router and instances as local processes")
    add_model(p)
    add_topology(p, "EPD")
    add_listen(p, 8000)
    add_transfer_require(p)
    add_serving_dtype(p, "every instance's weights, activations and KV cache (bfloat16 pays on CPUs with "
                         "native bf16; float32 is exact against transformers)")
    p.add_argument("--api-key-file", default=None, help="the router's API keys, one per line (or TRIPTYCH_API_KEY)")
    add_allow_no_api_key(p)
    add_instance_cpus(p, "cap every instance at X CPUs (its own cgroup, ceil(X) torch threads); "
                         "without root or a cpu controller it says so and runs uncapped")
    add_cpu_period(p, None, "with --instance-cpus: the quota's CFS period (default: the kernel's 100 ms; "
                            "a short one, e.g. 10, makes an instance a uniformly slower device)")
    add_threads(p, "torch threads per instance (default: ceil(X) with --instance-cpus, else the cores "
                   "but one, which is left to the router, shared out over the instances; at least 1) "
                   "(docs/benchmarks.md)")
    add_cpu_binding(p)
    add_stream_interval(p)
    add_no_stage_channel(p)
    p.add_argument("--autoscale", action="store_true", help="also run the planner (triptych autoscale)")
    p.add_argument("--planner-port", type=int, default=8090, help="with --autoscale: the planner's /metrics, /plan")
    p.add_argument("--autoscale-standby", type=int, default=0,
                   help="with --autoscale: extra unassigned instances encoder scaling takes before "
                        "it starts new processes")
    p.add_argument("--autoscale-video-standby", type=int, default=0,
                   help="with --autoscale: extra V processes, started parked, V scaling takes before it "
                        "starts new processes")
    p.add_argument("--autoscale-args", default="", help="with --autoscale: more `triptych autoscale` flags")
    add_admin_token_file(p, "admin token for the children (else TRIPTYCH_ADMIN_TOKEN, else one is generated "
                            "into ~/.cache/triptych/admin-token, mode 0600)")
    p.set_defaults(func=lazy("triptych.local:cli_main"))


def add_autoscale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autoscale", help="the planner beside a local deployment (docs/planner.md)")
    p.add_argument("--router", required=True, help="router base URL")
    add_admin_token_file(p, "the router's admin token")
    add_listen(p, 8090, "/metrics and /plan")
    p.add_argument("--spawn-spec", default=None,
                   help="how to start more instances (a file `serve --autoscale` writes): E and V scaling then "
                        "start and stop instance processes; without it they only use standbys")
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
    add_gpu(p, "replan on a roofline profile (needs --model)")
    add_model(p, None, "with --gpu: the model directory")
    add_planner_slos(p)
    p.set_defaults(func=lazy("triptych.operator.planner.local_main:cli_main"))
