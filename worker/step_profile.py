"""`triptych profile`: measure the step-time tables the planner simulates with, on this
device, through the engine's public API only (Engine, measure_encode, measure_prefill,
add_request/step). The output is operator/planner/profile.py's StepProfile as JSON.

Tables: encode by images and pixels (measure_encode), prefill by tokens (measure_prefill),
decode by batch size and context length (B requests with a C-token prompt are prefilled,
then the median of several pure decode steps is taken), migration by bytes (a copy of a
buffer of that size in this process's memory: the lower bound of a pull on one machine;
pass --migration-bytes-per-s for a measured NIXL figure).

`--cpu-share X` profiles an instance capped at X CPUs (`serve --instance-cpus X`) without
the cap: each step is timed by this process's CPU seconds and divided by X, the quota's
average rate. Timed inside the quota instead, a step of a few ms either fits in what is left
of the period or waits for the next one, so the medians of a few steps land on one side or
the other of a period's stall (a 16-token prefill measured slower than a 64-token one).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from triptych.cli_args import resolve_model
from triptych.operator.planner.model_shape import read_shape
from triptych.operator.planner.profile import DecodeRow, EncodeRow, Migration, Point, StepProfile
from triptych.sampling_params import SamplingParams
from triptych.topology import InstanceType
from triptych.worker.engine.engine import Engine, EngineConfig, make_request

log = logging.getLogger("triptych.profile")


Clock = Callable[[], float]


def measure(run: Callable[[], object], repeats: int, clock: Clock = time.perf_counter) -> float:
    """Median seconds of `run` by `clock` (wall, or `time.process_time` for CPU seconds)."""
    times = []
    for _ in range(repeats):
        t0 = clock()
        run()
        times.append(clock() - t0)
    return statistics.median(times)


def measure_decode(engine: Engine, batch: int, context: int, steps: int = 5,
                   clock: Clock = time.perf_counter) -> float:
    # The batch's first rows decode while the last ones prefill (one token budget a step):
    # none may finish before the timed steps, however many steps the prefills take.
    prompt_len = max(1, context)
    prefill_steps = batch * (-(-prompt_len // engine.token_budget) + 1)
    max_tokens = min(prefill_steps + steps + 4, engine.max_model_len - prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.spec.vocab_size
    ids = [f"profile-{batch}-{context}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for n, rid in enumerate(ids):
        prompt = [(7 * n + 3 * j) % (vocab - 1) + 1 for j in range(prompt_len)]
        engine.add_request(make_request(rid, prompt, params))
    try:
        deadline = time.monotonic() + 600
        while not all((r := engine.get_request(rid)) is not None and r.prefill_done for rid in ids):
            if time.monotonic() > deadline:
                raise TimeoutError("prefill of the decode batch did not finish")
            ended = [out.request_id for out in engine.step() if out.finished and out.request_id in ids]
            if ended:  # a finished or failed row: the batch would never be whole
                raise RuntimeError(f"profile request {ended[0]} ended before the decode steps were timed")
        return measure(engine.step, steps, clock)
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.step()


def monotone(points: list[Point]) -> list[Point]:
    """Step time does not fall as the batch grows (TriInfer Fig. 3): a point measured under
    its predecessor is noise from a shared machine; lift it to the running maximum."""
    out, top = [], 0.0
    for p in sorted(points, key=lambda p: p.x):
        top = max(top, p.seconds)
        out.append(Point(x=p.x, seconds=top))
    return out


def measure_copy(nbytes: int, repeats: int = 3) -> float:
    src = torch.empty(max(1, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), repeats)


def profile_engine(model: str, *, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
                   pixels: Sequence[int] = (64, 224, 448), images: Sequence[int] = (1, 2, 4),
                   tokens: Sequence[int] = (16, 64, 256, 1024), batches: Sequence[int] = (1, 4, 16),
                   contexts: Sequence[int] = (32, 256, 1024), migration_bytes_per_s: float | None = None,
                   max_num_seqs: int = 64, cpu_share: float | None = None) -> StepProfile:
    if cpu_share is not None and (device != "cpu" or not cpu_share > 0):
        raise ValueError(f"a CPU share needs --device cpu and a share > 0, got {device!r} and {cpu_share}")
    clock: Clock = time.process_time if cpu_share else time.perf_counter
    scale = 1.0 / cpu_share if cpu_share else 1.0

    def timed(run: Callable[[], object], repeats: int = 5) -> float:
        return measure(run, repeats, clock) * scale

    engine = Engine(EngineConfig(model=model, role=InstanceType.EPD, device=device, dtype=dtype, threads=threads,
                                 token_budget=max(tokens), image_budget=max(images), detokenize=False,
                                 max_num_seqs=max(max_num_seqs, max(batches))))
    max_len = engine.max_model_len
    engine.measure_prefill(min(tokens))  # warm-up: first calls pay for allocations and kernel selection
    engine.measure_encode(1, (pixels[0], pixels[0]))
    encode = [EncodeRow(pixels=side * side, points=monotone(
        [Point(x=n, seconds=timed(partial(engine.measure_encode, n, (side, side), repeats=1))) for n in images]))
        for side in pixels]
    prefill = monotone([Point(x=n, seconds=timed(partial(engine.measure_prefill, n, repeats=1)))
                        for n in tokens if n < max_len])
    decode = [DecodeRow(context=c, points=monotone([Point(x=b, seconds=measure_decode(engine, b, c, clock=clock) * scale)
                                                    for b in batches]))
              for c in contexts if c + 16 < max_len]
    if migration_bytes_per_s is None:
        size = 64 << 20
        migration_bytes_per_s = size / measure_copy(size)
    kv = engine.kv
    dtype_bytes = torch.empty(0, dtype=engine.config.torch_dtype).element_size()
    return StepProfile(
        source=f"measured:{device}" + (f" at {cpu_share:g} CPUs" if cpu_share else ""), shape=read_shape(model), dtype_bytes=dtype_bytes, encode=encode,
        prefill=prefill, decode=decode, migration=Migration(bytes_per_s=migration_bytes_per_s),
        kv_capacity_tokens=kv.num_blocks * kv.block_size if kv is not None else 1, max_num_seqs=max_num_seqs)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = str(resolve_model(args.model))
    cpu_share = getattr(args, "cpu_share", None)
    if cpu_share is not None and args.device != "cpu":
        print(f"error: --cpu-share profiles a CPU instance; got --device {args.device}", file=sys.stderr)
        return 2
    prof = profile_engine(model, device=args.device, dtype=args.dtype, threads=args.threads,
                          migration_bytes_per_s=args.migration_bytes_per_s,
                          tokens=getattr(args, "tokens", None) or (16, 64, 256, 1024),
                          batches=getattr(args, "batches", None) or (1, 4, 16),
                          contexts=getattr(args, "contexts", None) or (32, 256, 1024),
                          cpu_share=cpu_share)
    prof.save(args.out)
    print(json.dumps({"out": args.out, "source": prof.source, "prefill_points": len(prof.prefill),
                      "decode_rows": len(prof.decode), "encode_rows": len(prof.encode),
                      "kv_capacity_tokens": prof.kv_capacity_tokens}))
    return 0
