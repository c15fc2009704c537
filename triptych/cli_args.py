"""Options that several `triptych` subcommands take, each defined once here. What the
subcommands differ in (a default, a help line) is a parameter; the name, type, choices and
metavar are not, so `--instance-cpus` parses the same wherever it appears. Also the CPU
share type and the lazy entry point every subcommand uses."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

MODEL_HELP = "checkpoint directory, or 'tiny'"
GPUS = ("H100", "H200", "A100", "L40S")  # the roofline profiles a --gpu stand-in knows
LOOPBACK = "127.0.0.1"


def resolve_model(model: str) -> Path:
    """The checkpoint directory a `--model` names: `tiny` builds (once, cached, offline) the
    tiny Qwen2-VL checkpoint; anything else is a path holding a config.json, else a
    one-line error (exit 1)."""
    if model == "tiny":
        from triptych.tiny_model import tiny_model_path

        return tiny_model_path("qwen2-vl")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model!r}: no config.json there (expected a checkpoint directory, or 'tiny')")
    return path


def topology(text: str) -> str:
    """A topology string (`1E1P1D`, `EPD`, ...), checked by its parser; kept as text."""
    from triptych.topology import TopologyError, parse_topology

    try:
        parse_topology(text)
    except TopologyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def topologies(text: str) -> str:
    """Comma-separated topologies, each checked; kept as text."""
    for part in text.split(","):
        if part.strip():
            topology(part.strip())
    return text


def _positive(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text}")
    return value


def cpus(text: str) -> float:
    """A CPU share: a positive number of CPUs (0.5 = half a core)."""
    return _positive(text, "CPUs")


def cpu_list(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3,8"): the CPUs a process or thread is bound to."""
    from triptych.cpu_binding import parse_cpu_list

    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rate(text: str) -> float:
    """An arrival rate: a positive, finite number of requests per second."""
    return _positive(text, "requests/s")


def count(text: str) -> int:
    """A count of things (threads, instances): a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def lazy(target: str) -> Callable[[argparse.Namespace], int | None]:
    """`module:function`, imported only when the subcommand runs (so `--help` stays instant
    and `triptych operator` never imports torch)."""
    module_name, func_name = target.split(":")

    def run(args: argparse.Namespace) -> int | None:
        return getattr(importlib.import_module(module_name), func_name)(args)

    return run


# --- what to run --------------------------------------------------------------------------


def add_model(p: argparse.ArgumentParser, default: str | None = "tiny", help: str | None = MODEL_HELP,
              required: bool = False) -> None:
    p.add_argument("--model", default=default, required=required, help=help)


def add_topology(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--topology", type=topology, default=default)


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32")


SERVING_DTYPES = ("float32", "bfloat16")  # what `serve` passes each worker (its engine's EngineConfig.dtype)


def add_serving_dtype(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--dtype", choices=SERVING_DTYPES, default="float32", help=help)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")


def add_threads(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--threads", type=count, default=None, help=help)


def add_cpu_binding(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-binding", choices=("off", "auto"), default="off",
                   help="auto: where every instance can have --threads cores of its own and one is left, "
                        "bind each engine's step thread to its cores and the router and the workers' other "
                        "threads to the rest (as vLLM's CPU backend binds its OpenMP threads); not with "
                        "--instance-cpus or --autoscale (docs/internals.md)")


def add_stream_interval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-interval", type=count, default=1, metavar="N",
                   help="stream each request's tokens N at a time after its first (fewer stream writes "
                        "for the worker and the router; 1, the default: every token at once)")


def add_no_stage_channel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-stage-channel", action="store_true",
                   help="a stream per stage run instead of one event channel per worker carrying all "
                        "of its runs' events (router/stage_channel.py)")


def add_compile_decode(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--compile-decode", action="store_true", help=help)


def add_max_model_len(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--max-model-len", type=int, default=None, help=help)


def add_transfer_require(p: argparse.ArgumentParser, default: str = "any") -> None:
    p.add_argument("--transfer-require", choices=("any", "nixl"), default=default)


def add_instance_cpus(p: argparse.ArgumentParser, help: str, default: float | None = None,
                      required: bool = False) -> None:
    p.add_argument("--instance-cpus", type=cpus, default=default, required=required, metavar="X", help=help)


PRIORITY_HELP = "weight of each capped instance per CPU of quota (see bench neighbours)"


def add_priority(p: argparse.ArgumentParser, help: str = PRIORITY_HELP, default: float | None = 1.0) -> None:
    """The weight (cgroup cpu.weight / shares) of a capped instance: see bench neighbours."""
    p.add_argument("--priority", type=cpus, default=default, metavar="K", help=help)


PERIOD_HELP = ("the quota's CFS period: short, so a capped instance is a uniformly slower device "
               "rather than one that stalls most of each 100 ms (cpu_quota.py)")


def add_cpu_period(p: argparse.ArgumentParser, default: float | None = 10.0, help: str = PERIOD_HELP) -> None:
    """--instance-cpu-period-ms: the CPU quota's CFS period."""
    p.add_argument("--instance-cpu-period-ms", type=float, default=default, metavar="MS", help=help)


def add_log_dir(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--log-dir", default=None, help=help)


def add_gpu(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, help: str) -> None:
    p.add_argument("--gpu", default=None, choices=GPUS, help=help)


# --- listening and credentials ------------------------------------------------------------


def add_listen(p: argparse.ArgumentParser, port: int, port_help: str | None = None) -> None:
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=port, help=port_help)


def add_inherited_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fd", type=int, default=None,
                   help="serve on this inherited, already bound socket (a file descriptor; --host and --port "
                        "then only name it): how `triptych serve` starts its processes (listen_socket.py)")


def add_admin_token_file(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--admin-token-file", default=None, help=help)


def add_internal_token_file(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--internal-token-file", default=None, help=help)


def add_allow_no_api_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="serve a non-loopback --host without API keys (refused by default)")


def add_client_api_key(p: argparse.ArgumentParser) -> None:
    """The key a load generator sends (one; the router's own --api-key is a list)."""
    p.add_argument("--api-key", default=None)


# --- SLOs ---------------------------------------------------------------------------------


def add_slos(p: argparse.ArgumentParser, ttft: float | None, tbt: float | None, help: str | None = None) -> None:
    """--ttft-slo / --tbt-slo (seconds): what the servers and the benchmarks judge against."""
    p.add_argument("--ttft-slo", type=float, default=ttft, help=help)
    p.add_argument("--tbt-slo", type=float, default=tbt, help=help)


def add_planner_slos(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """--slo-ttft / --slo-tbt (seconds): the targets the planner plans for."""
    p.add_argument("--slo-ttft", type=float, default=2.0, help=help)
    p.add_argument("--slo-tbt", type=float, default=0.2, help=help)


# --- load and reports ---------------------------------------------------------------------


def add_rates(p: argparse.ArgumentParser, default: list[float]) -> None:
    p.add_argument("--rates", type=rate, nargs="+", default=default)


def add_image_size(p: argparse.ArgumentParser, default: list[int], metavar: tuple[str, str] | None = None) -> None:
    p.add_argument("--image-size", type=int, nargs=2, default=default, metavar=metavar)


def add_request_shape(p: argparse.ArgumentParser, num_requests: int, image_size: list[int],
                      image_metavar: tuple[str, str] | None = None) -> None:
    """How many requests and the images each carries."""
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--images-per-request", type=int, default=1)
    add_image_size(p, image_size, image_metavar)


def add_output_len(p: argparse.ArgumentParser, default: int, help: str | None = None) -> None:
    p.add_argument("--output-len", type=int, default=default, help=help)


def add_request_timeout(p: argparse.ArgumentParser, default: float = 120.0) -> None:
    p.add_argument("--request-timeout", type=float, default=default)


def add_seed(p: argparse.ArgumentParser, default: int | None = 0) -> None:
    p.add_argument("--seed", type=int, default=default)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def add_out_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-json", default=None, help="also write the JSON report here")
