"""`triptych bench attention`: the CPU paged decode kernel (worker/attention/cpu_decode.c)
against a cold KV cache, beside this machine's streaming read bandwidth in the same run.

A decode step of the engine reads every decoding sequence's keys and values once per layer,
from blocks that lie anywhere in a cache far larger than the CPU's caches. So this builds a
cache as the engine does (`zeroed()`, block-major, shuffled block tables), fills it, and
times one kernel call per layer, going through the layers in turn so that each call reads
memory the last did not. The kernel's figure is the K and V bytes it must read over its
time; the baseline is a sum over a tensor larger than the caches (the hardware prefetcher's
best case), on the same threads. Figures only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from triptych.worker.attention import cpu_decode
from triptych.worker.engine.zeroed import zeroed


def stream_read_gbs(nbytes: int, repeats: int = 3) -> float:
    """GB/s of a sum over an fp32 tensor of `nbytes` (best of `repeats`)."""
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def kernel_case(context: int, args: argparse.Namespace) -> dict[str, Any]:
    """One context length: the best of `args.repeats` sweeps over every layer, per layer."""
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = args.batch * blocks_per_seq + 1
    cache = zeroed((num_blocks, args.layers, 2, args.block_size, args.kv_heads, args.head_dim), dtype, "cpu")
    cache.normal_()
    order = list(range(num_blocks))
    random.Random(args.seed).shuffle(order)  # a long-running cache hands out blocks in no order
    tables = torch.tensor([order[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(args.batch)])
    lens = [context] * args.batch
    q = torch.randn(args.batch, args.kv_heads * args.group, args.head_dim, dtype=dtype)
    out = torch.empty_like(q)
    decode = cpu_decode.PagedDecode(list(range(args.batch)), tables, lens)
    best = float("inf")
    decode(q, cache, 0, out, args.kv_heads)  # the scratch row, outside the timing
    for _ in range(args.repeats):
        start = time.perf_counter()
        for layer in range(args.layers):
            decode(q, cache, layer, out, args.kv_heads)
        best = min(best, (time.perf_counter() - start) / args.layers)
    read = sum(lens) * 2 * args.kv_heads * args.head_dim * cache.element_size()
    return {"context": context, "us_per_layer": round(best * 1e6, 1), "read_gbs": round(read / best / 1e9, 2)}


class _threads:
    """torch's thread count for a `with` block, restored after it."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if cpu_decode.kernel() is None:
        raise SystemExit("the CPU decode kernel does not build here (no C compiler, or TRIPTYCH_CPU_ATTENTION=torch)")
    with _threads(args.threads):  # restored after: tests run this in their own process
        stream = stream_read_gbs(args.stream_mb << 20)
        cases = [kernel_case(c, args) for c in args.contexts]
    for case in cases:
        case["of_stream_read"] = round(case["read_gbs"] / stream, 3)
    shape = {k: getattr(args, k) for k in ("batch", "kv_heads", "group", "head_dim", "block_size", "layers",
                                           "dtype", "threads")}
    return {"shape": shape, "stream_read_gbs": round(stream, 2), "cases": cases}


def cli_main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    shape = report["shape"]
    print(f"paged decode kernel, {shape['batch']} sequences, {shape['kv_heads']} KV heads x {shape['group']}, "
          f"head_dim {shape['head_dim']}, block {shape['block_size']}, {shape['dtype']}, "
          f"{shape['threads']} thread(s); streaming read {report['stream_read_gbs']} GB/s")
    for case in report["cases"]:
        print(f"  context {case['context']:>5}: {case['us_per_layer']:8.1f} us/layer, "
              f"{case['read_gbs']:5.1f} GB/s ({case['of_stream_read']:.0%} of streaming read)")
    return 0
