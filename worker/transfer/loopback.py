"""A source instance in its own OS process, driven over a pipe: a real `TransferEngine`
with registered regions of known content, a `LeaseTable` and the lease pump. Used by the
transfer tests and the loopback bandwidth benchmark (two processes on one machine).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class RegionSpec:
    shape: tuple[int, ...]  # [num_blocks, ...block shape]
    dtype: str  # torch dtype name, e.g. "float16"
    seed: int = 0


def pattern(spec: RegionSpec) -> torch.Tensor:
    """Deterministic random content: the source's region, rebuilt anywhere for checks."""
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, generator=gen).to(dtype)
    return torch.randint(0, 100, spec.shape, generator=gen, dtype=torch.int64).to(dtype)


class PeerError(RuntimeError):
    """The source process failed or did not answer in time."""


class SourcePeer:
    """Spawns the source process; each method is one round trip to it."""

    def __init__(self, regions: dict[str, RegionSpec], *, name: str = "source",
                 require: Literal["nixl", "any"] = "any", nixl_plugin: str = "UCX",
                 start_timeout_s: float = 60.0) -> None:
        # forkserver: children fork from a clean server process (no NIXL/UCX threads to
        # inherit, unlike fork) that imported torch once (unlike spawn, ~seconds each).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["triptych.worker.transfer.loopback"])
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_peer_main, args=(child, regions, name, require, nixl_plugin),
                                 name=f"triptych-{name}", daemon=True)
        self._proc.start()
        child.close()
        ready = self._recv(start_timeout_s)
        self.transport: str = ready["transport"]
        self.agent_name: str = ready["agent_name"]

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def _recv(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise PeerError(f"source process {self._proc.name} did not answer within {timeout_s}s")
        try:
            reply = self._conn.recv()
        except EOFError as e:
            raise PeerError(f"source process exited (code {self._proc.exitcode})") from e
        if isinstance(reply, dict) and "error" in reply:
            raise PeerError(f"source process: {reply['error']}")
        return reply["ok"]

    def call(self, op: str, *args: Any, timeout_s: float = 10.0) -> Any:
        self._conn.send((op, args))
        return self._recv(timeout_s)

    def offer(self, region: str, block_ids: list[int], ttl_s: float, margin_s: float = 0.0) -> dict[str, Any]:
        """A lease on the source plus the handle for it (JSON dict, as a router carries it)."""
        return self.call("offer", region, block_ids, ttl_s, margin_s)

    def released(self) -> list[str]:
        """Lease ids whose on_release ran, in order (repeats would show a double free)."""
        return self.call("released")

    def outstanding(self) -> int:
        return self.call("outstanding")

    def expired_total(self, region: str) -> float:
        return self.call("expired_total", region)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", ()))
            except OSError:
                pass
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._conn.close()

    def __enter__(self) -> SourcePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _peer_main(conn: Connection, regions: dict[str, RegionSpec], name: str, require: str, plugin: str) -> None:
    try:
        asyncio.run(_serve(conn, regions, name, require, plugin))
    except EOFError:
        pass  # the parent went away


async def _serve(conn: Connection, regions: dict[str, RegionSpec], name: str, require: str, plugin: str) -> None:
    from prometheus_client import REGISTRY

    from triptych.worker.migration.leases import LeaseTable, run_lease_pump
    from triptych.worker.transfer.engine import TransferEngine

    try:
        engine = TransferEngine(name, require=require, nixl_plugin=plugin)  # type: ignore[arg-type]
        tensors = {r: pattern(spec) for r, spec in regions.items()}
        for region, tensor in tensors.items():
            engine.register(region, tensor)
    except Exception as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    table = LeaseTable(on_any_release=lambda lease: engine.revoke(lease.lease_id))
    released: list[str] = []

    def offer(region: str, block_ids: list[int], ttl_s: float, margin_s: float = 0.0) -> dict[str, Any]:
        ids: list[str] = []
        lease = table.offer(region, block_ids, lambda: released.append(ids[0]), ttl_s)
        ids.append(lease.lease_id)
        return engine.handle(region, block_ids, lease.lease_id, secret=lease.secret, ttl_s=ttl_s,
                             margin_s=margin_s).model_dump(mode="json")

    ops = {
        "offer": offer,
        "released": lambda: list(released),
        "outstanding": table.outstanding,
        "expired_total": lambda region: REGISTRY.get_sample_value(
            "triptych_worker_lease_expired_total", {"region": region}) or 0.0,
    }
    pump = asyncio.create_task(run_lease_pump(engine, table, interval_s=0.002))
    conn.send({"ok": {"transport": engine.transport, "agent_name": engine.agent_name}})
    loop = asyncio.get_running_loop()
    try:
        while True:
            op, args = await loop.run_in_executor(None, conn.recv)
            if op == "stop":
                break
            try:
                conn.send({"ok": ops[op](*args)})
            except Exception as e:
                conn.send({"error": f"{op}: {type(e).__name__}: {e}"})
    finally:
        pump.cancel()
        engine.close()
