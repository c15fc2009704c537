"""Raw READ bandwidth between two transfer agents in two processes over loopback.

`triptych bench serve --measure-nixl` prints it next to the serving figures, so migration
times can be read against what the transport itself does. Run alone:
`python -m triptych.bench.nixl_bandwidth`. torch and the worker's transfer code are
imported only when measuring: `bench serve` imports this module and stays torch-free.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Literal

from triptych.bench.errors import BenchError


def _measure(nbytes: int, iters: int, require: Literal["nixl", "any"]) -> tuple[float, str]:
    import torch

    from triptych.worker.transfer import TransferEngine
    from triptych.worker.transfer.loopback import RegionSpec, SourcePeer, pattern

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


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """NIXL logs to fd 1 (here and in the source peer's child process); `--json` must
    keep stdout to the one JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def measure_nixl(mib: int, iters: int = 10) -> dict[str, Any]:
    """The serving report's fields for raw loopback NIXL READ bandwidth; a failure is
    reported in `nixl_read_error`, never raised (the serving figures stand without it)."""
    if mib < 1 or iters < 1:
        raise BenchError(f"need --nixl-mib >= 1 and iters >= 1, got {mib}, {iters}")
    try:
        with stdout_to_stderr():
            bps = measure_read_bandwidth(mib << 20, iters, require="nixl")
        return {"nixl_read_gib_s": bps / 2**30, "nixl_read_mib": mib, "nixl_read_iters": iters}
    except Exception as exc:  # report, don't lose the serving figures over it
        return {"nixl_read_gib_s": None, "nixl_read_mib": mib, "nixl_read_error": f"{type(exc).__name__}: {exc}"}


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
