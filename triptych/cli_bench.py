"""`triptych bench ...`: the benchmarks that print figures. Arguments only; each benchmark's
work lives in its own module (triptych/bench/, worker/video/bench.py), imported lazily."""

from __future__ import annotations

import argparse

from triptych.cli_args import (
    PRIORITY_HELP,
    add_client_api_key,
    add_compile_decode,
    add_cpu_period,
    add_image_size,
    add_instance_cpus,
    add_json,
    add_log_dir,
    add_model,
    add_out_json,
    add_output_len,
    add_priority,
    add_rates,
    add_request_shape,
    add_request_timeout,
    add_seed,
    add_serving_dtype,
    add_slos,
    add_threads,
    add_topology,
    add_transfer_require,
    count,
    cpus,
    lazy,
    rate,
    topologies,
)

QUOTA_HELP = "CPU quota of every instance"
IGNORE_EOS_HELP = "tokens per request (ignore_eos)"


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    for add in (_add_engine, _add_attention, _add_throughput, _add_serve, _add_neighbours, _add_idle,
                _add_simulate_validate, _add_autoscale_shift, _add_video, _add_switch):
        add(bsub)


def _add_topologies(p: argparse.ArgumentParser, default: str | None, help: str | None = None) -> None:
    p.add_argument("--topologies", type=topologies, default=default, help=help)


def _add_capped_instances(p: argparse.ArgumentParser, cpus: float | None = 0.5, cpus_help: str = QUOTA_HELP,
                          priority: float | None = 1.0, priority_help: str = PRIORITY_HELP) -> None:
    """Every instance of the benchmark's local deployments under a CPU quota, its CFS
    period and its weight: simulate-validate and autoscale-shift run the same way."""
    add_instance_cpus(p, cpus_help, cpus)
    add_cpu_period(p)
    add_priority(p, priority_help, priority)


def _add_local_run_report(p: argparse.ArgumentParser) -> None:
    """The tail of a benchmark that starts its own local deployments and writes a report."""
    add_transfer_require(p)
    add_request_timeout(p)
    add_log_dir(p)
    add_seed(p)
    add_json(p)
    add_out_json(p)


def _add_engine(bsub: argparse._SubParsersAction) -> None:
    e = bsub.add_parser("engine", help="our engine vs transformers generate() on CPU")
    add_model(e, None, "checkpoint dir (default: build the small Qwen2-VL)")
    e.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    add_output_len(e, 32)
    add_threads(e)
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="both systems' weights and KV (bfloat16 pays on CPUs with native bf16)")
    add_compile_decode(e, "torch.compile our decode step")
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
    add_json(e)
    e.set_defaults(func=lazy("triptych.bench.engine:cli_main"))


def _add_attention(bsub: argparse._SubParsersAction) -> None:
    a = bsub.add_parser("attention", help="the CPU paged decode kernel on a cold KV cache vs streaming read bandwidth")
    a.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512], help="cached tokens per sequence")
    a.add_argument("--batch", type=int, default=32, help="decoding sequences")
    a.add_argument("--kv-heads", type=int, default=4)
    a.add_argument("--group", type=int, default=2, help="query heads per KV head")
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--block-size", type=int, default=16)
    a.add_argument("--layers", type=int, default=8, help="layers swept in turn (each call reads a cold layer)")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the cache's dtype")
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--repeats", type=int, default=5, help="sweeps per context; the best is reported")
    a.add_argument("--stream-mb", type=int, default=512,
                   help="the streaming-read baseline's tensor (MiB; well past the last-level cache)")
    add_seed(a)
    add_json(a)
    a.set_defaults(func=lazy("triptych.bench.attention:cli_main"))


def _add_throughput(bsub: argparse._SubParsersAction) -> None:
    t = bsub.add_parser("throughput", help="closed-loop text load against an OpenAI server (and the engine)")
    t.add_argument("--url", default=None, help="server base URL (Triptych router, vLLM, ...)")
    t.add_argument("--engine", default=None, metavar="MODEL",
                   help="also run the same requests through our engine in-process (checkpoint dir)")
    t.add_argument("--workload", choices=("uniform", "longtail", "both"), default="both")
    t.add_argument("--num-requests", type=int, default=64)
    t.add_argument("--concurrency", type=int, default=32)
    add_output_len(t, 128, "uniform: tokens per completion")
    t.add_argument("--min-len", type=int, default=8, help="longtail: shortest completion")
    t.add_argument("--max-len", type=int, default=512, help="longtail: longest completion")
    t.add_argument("--repeats", type=int, default=2, help="runs of each (in turns); the best is reported")
    t.add_argument("--no-stream", action="store_true",
                   help="unstreamed completions (the answer whole, no TTFT), for the HTTP half")
    add_seed(t)
    add_client_api_key(t)
    add_request_timeout(t, 600.0)
    add_json(t)
    t.set_defaults(func=lazy("triptych.bench.throughput:cli_main"))


def _add_serve(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("serve", help="Poisson load against a running router (or local topologies)")
    s.add_argument("--url", default=None, help="router base URL (or use --topologies)")
    add_rates(s, [1.0, 2.0, 4.0])
    add_request_shape(s, 32, [64, 64])
    s.add_argument("--prompt-len", type=int, default=32)
    add_output_len(s, 16)
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this JSON-lines trace ({t, images, prompt_tokens, output_tokens} a line) "
                        "instead of the synthetic Poisson workload")
    s.add_argument("--trace-rates", type=float, nargs="+", default=None,
                   help="with --trace: re-time the trace to these mean rates (default: its own times)")
    add_slos(s, 2.0, 0.2)
    s.add_argument("--plot", default=None, help="write attainment-vs-rate PNG here")
    add_seed(s)
    add_json(s)
    add_out_json(s)
    s.add_argument("--sweep", action="store_true", help="double from the first rate, then bisect: goodput")
    s.add_argument("--sweep-max-rate", type=float, default=64.0)
    s.add_argument("--sweep-steps", type=int, default=2, help="bisection steps after the first failing rate")
    s.add_argument("--attainment-target", type=float, default=0.9)
    add_request_timeout(s)
    s.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted")
    s.add_argument("--worker-urls", nargs="*", default=[], help="workers to scrape /metrics from")
    add_client_api_key(s)
    s.add_argument("--measure-nixl", action="store_true", help="also measure raw NIXL READ bandwidth")
    s.add_argument("--nixl-mib", type=int, default=64)
    _add_topologies(s, None, "e.g. EPD,1E1P1D,1EP1D: start each locally in turn")
    add_model(s, help="with --topologies: checkpoint directory, or 'tiny'")
    add_transfer_require(s, "nixl")
    add_serving_dtype(s, "with --topologies: every instance's dtype (serve --dtype)")
    add_log_dir(s, "with --topologies: process logs go here")
    s.add_argument("--idle-seconds", type=float, default=3.0,
                   help="with --topologies: measure idle CPU this long before the load (0: skip)")
    add_instance_cpus(s, "with --topologies: cap every instance at X CPUs (cgroup quota)")
    s.add_argument("--total-cpus", type=cpus, default=None, metavar="T",
                   help="with --topologies: each topology gets T CPUs, split evenly over its instances")
    s.set_defaults(func=lazy("triptych.bench.serve:cli_main"))


def _add_neighbours(bsub: argparse._SubParsersAction) -> None:
    n = bsub.add_parser("neighbours", help="an instance's decode throughput alone and with busy neighbours")
    add_instance_cpus(n, QUOTA_HELP, required=True)
    n.add_argument("--neighbours", type=int, default=3, help="busy EPD instances beside the target")
    n.add_argument("--concurrency", type=int, default=4, help="streams per instance (closed loop)")
    add_output_len(n, 64, IGNORE_EOS_HELP)
    n.add_argument("--seconds", type=float, default=20.0, help="length of each measurement window")
    n.add_argument("--ramp", type=float, default=3.0, help="seconds of neighbour load before measuring")
    add_model(n)
    add_request_timeout(n)
    add_priority(n, "weight of each capped instance: K busy tasks per CPU of quota (K > 1: the quota, "
                    "not other load on a busy machine, bounds it; it takes CPU from other processes)")
    n.add_argument("--no-contrast", action="store_true", help="skip the run without quotas")
    add_json(n)
    n.set_defaults(func=lazy("triptych.bench.neighbours:cli_main"))


def _add_idle(bsub: argparse._SubParsersAction) -> None:
    i = bsub.add_parser("idle", help="CPU each process of an idle local deployment uses")
    add_topology(i, "1E1P1D")
    i.add_argument("--seconds", type=float, default=20.0, help="length of the sampling window")
    i.add_argument("--settle", type=float, default=2.0, help="seconds to wait after ready before sampling")
    add_model(i)
    add_transfer_require(i)
    add_json(i)
    i.set_defaults(func=lazy("triptych.bench.idle_cpu:cli_main"))


def _add_simulate_validate(bsub: argparse._SubParsersAction) -> None:
    v = bsub.add_parser("simulate-validate",
                        help="the planner's simulator vs measured local runs of the same trace (TTFT/TPOT error)")
    add_model(v)
    _add_topologies(v, "EPD,1EP1D,1E1P1D")
    add_rates(v, [1.0, 3.0])
    add_request_shape(v, 16, [224, 224])
    v.add_argument("--prompt-tokens", type=int, default=32, help="text tokens per request")
    v.add_argument("--output-tokens", type=int, default=16)
    _add_capped_instances(v)
    v.add_argument("--profile", default=None, help="a profile JSON (default: measure one at the quota)")
    v.add_argument("--save-profile", default=None, help="where the measured profile goes")
    v.add_argument("--fit-overheads", action=argparse.BooleanOptionalAction, default=True,
                   help="fit the fixed per-step and per-request costs from a lone request per topology")
    v.add_argument("--fit-request-work", action=argparse.BooleanOptionalAction, default=True,
                   help="with --fit-overheads: charge the instances' CPU per request, beyond their steps, "
                        "as busy time (else all of it is latency)")
    v.add_argument("--request-work-beside", action=argparse.BooleanOptionalAction, default=True,
                   help="the simulated request work runs before the request queues, sharing the instance's "
                        "CPU with the step under way (else it is charged to the first step that takes it on)")
    v.add_argument("--resimulate", default=None, metavar="JSON",
                   help="compare a saved run (--out-json) with the simulator again, measuring nothing "
                        "(with the --profile it used)")
    v.add_argument("--repeats", type=int, default=1, help="deployments measured per topology (fresh each): "
                   "the measured figures are their medians and the table shows how far apart they were")
    v.add_argument("--calibration-warmups", type=int, default=30, metavar="N",
                   help="untimed lone requests before the calibration's timed ones (a fresh deployment's "
                        "first requests are slower)")
    v.add_argument("--calibration-requests", type=count, default=15, metavar="N",
                   help="timed lone requests of the calibration: their medians fit the served path's "
                        "costs, and a lone TTFT spreads widely here (a capped instance's period phase), "
                        "so a median of 15 moved by up to 18%% (TTFT) and 23%% (TPOT) between three "
                        "calibrations of one 1E1P1D deployment at 0.25 CPU")
    v.add_argument("--lone-noise", action=argparse.BooleanOptionalAction, default=True,
                   help="with --fit-overheads: give each simulated request, in turn, one lone request's "
                        "measured TTFT spread around the median (and its TPOT as a factor on the median)")
    add_slos(v, 2.0, 0.2)
    _add_local_run_report(v)
    v.set_defaults(func=lazy("triptych.bench.sim_validate:cli_main"))


def _add_autoscale_shift(bsub: argparse._SubParsersAction) -> None:
    a = bsub.add_parser("autoscale-shift",
                        help="serve --autoscale vs static under a workload shift (SLO attainment, lost requests)")
    add_model(a)
    add_topology(a, "2E1P1D")
    _add_capped_instances(a, None, QUOTA_HELP + "; default: 0.5 (text), 0.25 (outputs)",
                          None, PRIORITY_HELP + "; default: 1 (text), 16 (outputs)")
    a.add_argument("--rate", type=rate, default=None, help="requests/s in both phases; default: 2 (text), "
                   "1.5 (outputs)")
    a.add_argument("--phase-seconds", type=float, default=None, help="length of each phase; default: 40 (text), "
                   "30 (outputs)")
    a.add_argument("--after-seconds", type=float, default=None,
                   help="length of the phase after the shift; default: --phase-seconds (text), 120 (outputs)")
    add_image_size(a, [224, 224])
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
    _add_local_run_report(a)
    a.set_defaults(func=lazy("triptych.bench.autoscale_shift:cli_main"))


def _add_video(bsub: argparse._SubParsersAction) -> None:
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
    add_model(v, None, "checkpoint whose processor config the V row patchifies with (default: tiny Qwen2-VL)")
    add_json(v)
    v.set_defaults(func=lazy("triptych.worker.video.bench:cli_main"))


def _add_switch(bsub: argparse._SubParsersAction) -> None:
    w = bsub.add_parser("switch", help="role switch times (POST /admin/role) idle and under streams")
    add_topology(w, "2E2P2D")
    add_model(w)
    w.add_argument("--concurrency", type=int, default=16, help="streams running during each loaded switch")
    add_output_len(w, 64, IGNORE_EOS_HELP)
    w.add_argument("--images", type=int, default=1, help="images per request")
    w.add_argument("--min-running", type=int, default=2,
                   help="a D->X switch waits until the instance runs this many decodes (or its "
                        "round-robin share of --concurrency, if fewer)")
    w.add_argument("--switch-after", type=float, default=0.3, help="seconds into the load before other switches")
    w.add_argument("--steady", type=float, default=0.05,
                   help="seconds a D->X switch waits after --min-running, for admissions to settle")
    w.add_argument("--settle", type=float, default=1.5, help="seconds between switches (router poll)")
    add_instance_cpus(w, "cap every instance at X CPUs")
    add_cpu_period(w)
    add_priority(w)
    add_log_dir(w, "write each process's log here")
    add_request_timeout(w, 180.0)
    add_json(w)
    w.set_defaults(func=lazy("triptych.bench.switch:cli_main"))
