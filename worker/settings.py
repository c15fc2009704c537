"""What one worker process is configured with: its CLI flags, and the operator's serving
config file (TRIPTYCH_CONFIG) that can set engine limits and budgets."""

from __future__ import annotations

import argparse
from typing import Any, Literal

from pydantic import BaseModel

from triptych.topology import UNASSIGNED


class WorkerSettings(BaseModel):
    model: str
    role: str = UNASSIGNED
    instance_id: str = "worker"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    parallel_vision: bool = True  # encodes on a side CUDA stream (engine/parallel_vision.py)
    num_mm_blocks: int | None = None
    transfer_require: Literal["any", "nixl"] = "any"
    lease_seconds: float = 30.0
    pull_timeout_s: float = 20.0  # below lease_seconds: the source must not free mid-READ
    lease_margin_s: float = 1.0  # handles' expiry is this much before the source frees
    drain_timeout_s: float = 60.0
    # Live-migration pre-copy (a switch or drain moving decodes): how long the decodes go on
    # here while their new instance pulls their full KV blocks; 0 moves them whole at once.
    precopy_timeout_s: float = 0.25
    # P <-> D answers once the new role runs; the old decodes move out after (live_switch.py).
    live_switch: bool = True
    # A greedy or seeded decode moving out keeps decoding here until its new instance takes
    # over (make-before-break, worker/engine/token_feed.py); off: it parks at once.
    live_handover: bool = True
    compile_decode: bool = False  # EngineConfig.compile_decode
    engine_cpus: tuple[int, ...] | None = None  # EngineConfig.cpus (triptych/cpu_binding.py)
    stream_interval: int = 1  # EngineConfig.stream_interval
    decode_threads: int = 2  # image decode + preprocessing pool (admission.py)
    # Image jobs (one or two per stage run with images) running or queued before stage runs
    # get 503. Generous: the router takes a 503 as this instance failing (out of rotation
    # until its next probe), so it must mean a real overload, not a burst.
    decode_queue: int = 128
    # Video buffers (worker/video_buffer.py): a V instance's decoded patches awaiting pulls,
    # an encode instance's staging for the patches it pulls; a V's held uploads.
    video_buffer_mb: int = 256
    video_cache_mb: int = 512
    # A V instance's decoder: NVDEC (PyNvVideoCodec) where a CUDA device and the library are
    # there, else PyAV on the CPU ("auto"); "pyav" / "nvdec" force one.
    video_decoder: Literal["auto", "pyav", "nvdec"] = "auto"
    max_model_len: int | None = None
    token_budget: int | None = None
    image_budget: int | None = None
    encode_token_budget: int | None = None  # UnifiedServe Alg. 3 alpha (shared-GPU pools)
    ttft_slo_s: float | None = None  # budgets from the SLO by start-up profiling (profiler.py)
    tbt_slo_s: float | None = None


def settings_from_serving_config(path: str) -> dict[str, Any]:
    """Engine settings from the operator's serving config (the ConfigMap file named by
    TRIPTYCH_CONFIG): context length, block size, and fixed budgets or SLO-derived ones."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    model, slo, sched = config.get("model", {}), config.get("slo", {}), config.get("scheduling", {})
    out: dict[str, Any] = {}
    if model.get("maxModelLen"):
        out["max_model_len"] = int(model["maxModelLen"])
    if model.get("dtype"):
        out["dtype"] = str(model["dtype"])
    if sched.get("blockSize"):
        out["block_size"] = int(sched["blockSize"])
    if sched.get("budgets") == "Fixed":
        out.update(token_budget=sched.get("tokenBudget"), image_budget=sched.get("imageBudget"))
    elif slo:
        out.update(ttft_slo_s=slo.get("ttftMs", 2000) / 1000, tbt_slo_s=slo.get("tbtMs", 200) / 1000)
    return out


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    """`triptych worker` flags over the serving config file (flags win)."""
    from_file = settings_from_serving_config(args.config) if args.config else {}
    flags = {"max_model_len": args.max_model_len, "token_budget": args.token_budget,
             "image_budget": args.image_budget,
             "encode_token_budget": getattr(args, "encode_token_budget", None), "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo}
    return WorkerSettings(**{
        "dtype": args.dtype, "block_size": args.block_size, **from_file,
        **{k: v for k, v in flags.items() if v is not None},
        "model": str(args.model), "role": args.role,
        "instance_id": args.instance_id or f"{args.role}-{args.port}", "device": args.device,
        "num_kv_blocks": args.num_kv_blocks, "num_mm_blocks": args.num_mm_blocks,
        "enable_prefix_caching": not getattr(args, "no_prefix_caching", False),
        "parallel_vision": not getattr(args, "no_parallel_vision", False),
        "transfer_require": args.transfer_require, "lease_seconds": args.lease_seconds,
        "pull_timeout_s": min(20.0, args.lease_seconds * 0.66),
        "precopy_timeout_s": getattr(args, "precopy_timeout", 0.25),
        "live_switch": not getattr(args, "no_live_switch", False),
        "live_handover": not getattr(args, "no_live_handover", False),
        "decode_threads": getattr(args, "decode_threads", 2),
        "video_decoder": getattr(args, "video_decoder", "auto"),
        "compile_decode": getattr(args, "compile_decode", False),
        "engine_cpus": getattr(args, "engine_cpus", None),
        "stream_interval": getattr(args, "stream_interval", 1)})
