"""Raw READ bandwidth between two transfer agents in two processes over loopback.

`triptych bench serve` prints it next to the serving figures, so migration times can be
read against what the transport itself does. Run: `python -m triptych.worker.transfer.bandwidth`.
"""

from __future__ import annotations

import argparse
import time
from typing import Literal

import torch

from triptych.worker.transfer.loopback import RegionSpec, SourcePeer, pattern
from triptych.worker.transfer.nixl import TransferEngine


def _measure(nbytes: int, iters: int, require: Literal["nixl", "any"]) -> tuple[float, str]:
    if nbytes <= 0 or iters <= 0:
        raise ValueError(f"nbytes and iters must be > 0, got {nbytes}, {iters}")
    spec = RegionSpec((1, nbytes), "uint8", seed=7)  # one block: one descriptor per READ
    with SourcePeer({"buf": spec}, name="bw-source", require=require) as peer, \
            TransferEngine("bw-target", require=require) as engine:
        dst = torch.zeros((1, nbytes), dtype=torch.uint8)
        engine.register("buf", dst)
        handle = peer.offer("buf", [0], ttl_s=3600)
        engine.pull(handle, "buf", [0], timeout_s=60, notify=False)  # warm-up: connects
        if not torch.equal(dst, pattern(spec)):
            raise RuntimeError("loopback READ delivered wrong bytes")
        started = time.perf_counter()
        for _ in range(iters):
            engine.pull(handle, "buf", [0], timeout_s=60, notify=False)
        elapsed = time.perf_counter() - started
        return nbytes * iters / elapsed, engine.transport


def measure_read_bandwidth(nbytes: int, iters: int, *, require: Literal["nixl", "any"] = "nixl") -> float:
    """Bytes/s of back-to-back READs of one `nbytes` region (after one warm-up READ)."""
    return _measure(nbytes, iters, require)[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="size of one READ in MiB")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--require", choices=("nixl", "any"), default="nixl")
    args = p.parse_args(argv)
    bps, transport = _measure(args.mib << 20, args.iters, args.require)
    print(f"loopback READ ({transport}): {args.mib} MiB x {args.iters}: {bps / 2**30:.2f} GiB/s")


if __name__ == "__main__":
    main()
