"""Real NIXL (UCX) block transfers between two OS processes over loopback.

The source is a spawned process (`loopback.SourcePeer`) holding KV- and MM-shaped regions
of known random content; the target is this test process.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from polling import wait_until
from prometheus_client import REGISTRY

from triptych.worker.transfer import (
    IncompatibleHandleError,
    PeerUnreachableError,
    TransferEngine,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
)
from triptych.worker.transfer.base import BlockHandle, Region, segments
from triptych.worker.transfer.loopback import RegionSpec, SourcePeer, pattern

# KV: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; MM: [num_blocks, rows, hidden]
KV = RegionSpec((12, 2, 2, 4, 2, 8), "float16", seed=1)
MM = RegionSpec((10, 4, 32), "bfloat16", seed=2)
LOCAL_BLOCKS = 16




def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def local_cache(spec: RegionSpec) -> torch.Tensor:
    return torch.zeros((LOCAL_BLOCKS, *spec.shape[1:]), dtype=getattr(torch, spec.dtype))


@pytest.fixture(scope="module")
def source() -> Iterator[SourcePeer]:
    with SourcePeer({"kv": KV, "mm": MM}, name="src", require="nixl") as peer:
        yield peer


@pytest.fixture(scope="module")
def target() -> Iterator[TransferEngine]:
    with TransferEngine("dst", require="nixl") as engine:
        engine.register("kv", local_cache(KV))
        engine.register("mm", local_cache(MM))
        yield engine


def region_tensor(engine: TransferEngine, region: str) -> torch.Tensor:
    return engine._regions[region].tensor


def check_pulled(engine: TransferEngine, region: str, spec: RegionSpec, src_ids: list[int],
                 dst_ids: list[int]) -> None:
    local, expected = region_tensor(engine, region), pattern(spec)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(local[d], expected[s]), f"local block {d} != source block {s}"


def test_nixl_is_the_transport(source: SourcePeer, target: TransferEngine) -> None:
    assert target.transport == "nixl-ucx"
    assert source.transport == "nixl-ucx"


def test_pull_kv_blocks_into_noncontiguous_ids(source: SourcePeer, target: TransferEngine) -> None:
    src_ids, dst_ids = [3, 4, 5, 9, 0], [8, 9, 10, 2, 14]  # one coalescable run + two singles
    labels = {"transport": "nixl-ucx", "direction": "pull", "region": "kv"}
    bytes_before = sample("triptych_worker_transfer_bytes_total", **labels)
    count_before = sample("triptych_worker_transfer_seconds_count", **labels)
    untouched = [b for b in range(LOCAL_BLOCKS) if b not in dst_ids]
    region_tensor(target, "kv")[untouched] = 0

    handle = source.offer("kv", src_ids, ttl_s=30)
    moved = target.pull(handle, "kv", dst_ids, timeout_s=5)

    block_nbytes = target._regions["kv"].block_nbytes
    assert moved == len(src_ids) * block_nbytes
    check_pulled(target, "kv", KV, src_ids, dst_ids)
    assert not region_tensor(target, "kv")[untouched].any(), "a block outside the pull was written"
    assert sample("triptych_worker_transfer_bytes_total", **labels) - bytes_before == moved
    assert sample("triptych_worker_transfer_seconds_count", **labels) - count_before == 1


def test_source_frees_once_after_notification(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("mm", [1, 2], ttl_s=30)
    assert handle["lease_id"] not in source.released()
    target.pull(handle, "mm", [6, 3], timeout_s=5)
    assert wait_until(lambda: handle["lease_id"] in source.released()), "source never freed the lease"
    time.sleep(0.05)  # give a double release the chance to show
    assert source.released().count(handle["lease_id"]) == 1


async def test_concurrent_pulls_from_worker_threads(source: SourcePeer, target: TransferEngine) -> None:
    # The worker server runs pulls via asyncio.to_thread while its event loop keeps going.
    kv = source.offer("kv", [11, 10], ttl_s=30)
    mm = source.offer("mm", [0, 9, 4], ttl_s=30)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    tick_task = asyncio.create_task(ticker())
    moved = await asyncio.wait_for(asyncio.gather(
        asyncio.to_thread(target.pull, kv, "kv", [0, 1], timeout_s=5),
        asyncio.to_thread(target.pull, mm, "mm", [15, 7, 11], timeout_s=5),
    ), timeout=10)
    tick_task.cancel()
    assert moved == [2 * target._regions["kv"].block_nbytes, 3 * target._regions["mm"].block_nbytes]
    check_pulled(target, "kv", KV, [11, 10], [0, 1])
    check_pulled(target, "mm", MM, [0, 9, 4], [15, 7, 11])
    assert ticks > 0


def test_handle_is_json_round_trippable(source: SourcePeer) -> None:
    handle = BlockHandle.model_validate(source.offer("kv", [2], ttl_s=1))
    assert BlockHandle.model_validate_json(handle.model_dump_json()) == handle
    assert handle.dtype == "float16" and handle.block_shape == list(KV.shape[1:])
    assert handle.agent_name == source.agent_name


def test_incompatible_handles_are_refused_before_moving(source: SourcePeer, target: TransferEngine) -> None:
    mm = source.offer("mm", [1, 2], ttl_s=1)
    labels = {"transport": "nixl-ucx", "direction": "pull", "region": "kv"}
    before = sample("triptych_worker_transfer_bytes_total", **labels)
    with pytest.raises(IncompatibleHandleError, match="block layout differs"):
        target.pull(mm, "kv", [0, 1], timeout_s=2)
    with pytest.raises(IncompatibleHandleError, match="2 remote blocks but 1 local"):
        target.pull(mm, "mm", [0], timeout_s=2)
    with pytest.raises(IncompatibleHandleError, match="out of range"):
        target.pull(mm, "mm", [0, LOCAL_BLOCKS], timeout_s=2)
    with pytest.raises(IncompatibleHandleError, match="duplicate"):
        target.pull(mm, "mm", [3, 3], timeout_s=2)
    with pytest.raises(IncompatibleHandleError, match="transport"):
        target.pull({**mm, "transport": "tcp"}, "mm", [0, 1], timeout_s=2)
    with pytest.raises(KeyError, match="unknown region"):
        target.pull(mm, "nope", [0, 1], timeout_s=2)
    assert sample("triptych_worker_transfer_bytes_total", **labels) == before


def test_segments_coalesce_adjacent_runs() -> None:
    local = Region.of("kv", torch.zeros(8, 4, dtype=torch.float32))  # 16 B blocks
    handle = BlockHandle(transport="t", agent_name="a", agent_metadata="", region="kv", mem_type="DRAM",
                         device_id=0, base_addr=1000, block_nbytes=16, num_blocks=8,
                         block_ids=[0, 1, 2, 5, 6, 3], lease_id="l", lease_secret="s", expires_at=0.0, dtype="float32", block_shape=[4])
    segs = segments(handle, local, [4, 5, 6, 0, 1, 7])
    base = local.base_addr
    assert [(s.remote_addr, s.local_addr, s.nbytes) for s in segs] == [
        (1000, base + 64, 48), (1080, base, 32), (1048, base + 112, 16)]


class _Ticker:
    """Counts the event loop's turns while a pull waits: a loop the pull blocked counts none."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)

    def stop(self) -> int:
        self._task.cancel()
        return self.ticks


def _no_thread(*args: object, **kwargs: object) -> None:
    raise AssertionError("a NIXL pull_async went to a worker thread")


async def test_pull_async_waits_on_the_event_loop_without_a_thread(
        source: SourcePeer, target: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL's READ is posted and polled from the loop: no thread hand-off, no wake-up after."""
    monkeypatch.setattr(asyncio, "to_thread", _no_thread)
    handle = source.offer("kv", [2, 6, 7], ttl_s=30)
    phases: dict[str, float] = {}
    moved = await asyncio.wait_for(target.pull_async(handle, "kv", [5, 13, 4], timeout_s=5, phases=phases), 10)
    assert moved == 3 * target._regions["kv"].block_nbytes
    check_pulled(target, "kv", KV, [2, 6, 7], [5, 13, 4])
    assert phases["dispatch"] == phases["resume"] == 0.0 and {"prepare", "read", "confirm"} <= set(phases)
    assert wait_until(lambda: handle["lease_id"] in source.released()), "the pull was not confirmed"


async def test_pull_async_of_a_hung_peer_times_out_and_leaves_the_loop_running(target: TransferEngine) -> None:
    labels = {"transport": "nixl-ucx", "direction": "pull", "region": "mm", "reason": "timeout"}
    timeouts_before = sample("triptych_worker_transfer_failures_total", **labels)
    with SourcePeer({"mm": MM}, name="victim-async", require="nixl") as victim:
        handle = victim.offer("mm", [0, 1], ttl_s=30)
        os.kill(victim.pid, signal.SIGSTOP)  # alive but never answers
        try:
            ticker = _Ticker()
            started = time.monotonic()
            with pytest.raises(TransferTimeoutError):
                await target.pull_async(handle, "mm", [0, 1], timeout_s=1.0)
            waited = time.monotonic() - started
            assert waited < 1.0 + 3
            assert ticker.stop() > 50, "the event loop stood still while the READ waited"
            assert sample("triptych_worker_transfer_failures_total", **labels) == timeouts_before + 1
        finally:
            os.kill(victim.pid, signal.SIGKILL)
        victim._proc.join(5)
        with pytest.raises(PeerUnreachableError, match="DISCONNECT"):
            await asyncio.wait_for(target.pull_async(handle, "mm", [0, 1], timeout_s=1.0), 5)


def test_bogus_metadata_fails_fast(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("mm", [5], ttl_s=1)
    started = time.monotonic()
    with pytest.raises(PeerUnreachableError, match="cannot load metadata"):
        target.pull({**handle, "agent_metadata": base64.b64encode(b"garbage").decode()}, "mm", [0], timeout_s=2)
    with pytest.raises(PeerUnreachableError, match="not base64"):
        target.pull({**handle, "agent_metadata": "***"}, "mm", [0], timeout_s=2)
    assert time.monotonic() - started < 2


def test_hung_then_dead_peer_fails_within_timeout(target: TransferEngine) -> None:
    labels = {"transport": "nixl-ucx", "direction": "pull", "region": "mm", "reason": "timeout"}
    timeouts_before = sample("triptych_worker_transfer_failures_total", **labels)
    with SourcePeer({"mm": MM}, name="victim", require="nixl") as victim:
        handle = victim.offer("mm", [0, 1], ttl_s=30)
        os.kill(victim.pid, signal.SIGSTOP)  # alive but never answers
        try:
            started = time.monotonic()
            with pytest.raises(TransferTimeoutError):
                target.pull(handle, "mm", [0, 1], timeout_s=1.0)
            assert time.monotonic() - started < 1.0 + 3
            assert sample("triptych_worker_transfer_failures_total", **labels) == timeouts_before + 1
        finally:
            os.kill(victim.pid, signal.SIGKILL)
        victim._proc.join(5)

        started = time.monotonic()
        with pytest.raises(PeerUnreachableError, match="DISCONNECT"):
            target.pull(handle, "mm", [0, 1], timeout_s=1.0)
        assert time.monotonic() - started < 1.0 + 3

        # A target that never met the (now dead) source cannot even connect.
        with TransferEngine("fresh", require="nixl") as fresh:
            fresh.register("mm", local_cache(MM))
            started = time.monotonic()
            with pytest.raises(PeerUnreachableError):
                fresh.pull(handle, "mm", [0, 1], timeout_s=1.0)
            assert time.monotonic() - started < 1.0 + 3


def test_require_nixl_refuses_a_missing_backend() -> None:
    with pytest.raises(TransportUnavailableError, match="NO_SUCH_PLUGIN"):
        TransferEngine("strict", require="nixl", nixl_plugin="NO_SUCH_PLUGIN")
    with pytest.raises(ValueError, match="require"):
        TransferEngine("x", require="maybe")  # type: ignore[arg-type]


def test_require_any_falls_back_to_tcp_loudly(caplog: pytest.LogCaptureFixture) -> None:
    """The fallback is explicit: a warning, its own transport label, and it moves the bytes."""
    with caplog.at_level(logging.WARNING, logger="triptych.worker.transfer"):
        target = TransferEngine("dst-tcp", require="any", nixl_plugin="NO_SUCH_PLUGIN")
    with target:
        assert target.transport == "tcp"
        assert any("falling back to the TCP transport" in r.getMessage() for r in caplog.records)
        assert any("uses transport tcp" in r.getMessage() for r in caplog.records)
        target.register("kv", local_cache(KV))
        with SourcePeer({"kv": KV}, name="src-tcp", require="any", nixl_plugin="NO_SUCH_PLUGIN") as source:
            assert source.transport == "tcp"
            labels = {"transport": "tcp", "direction": "pull", "region": "kv"}
            before = sample("triptych_worker_transfer_bytes_total", **labels)
            handle = source.offer("kv", [7, 8, 1], ttl_s=30)
            moved = target.pull(handle, "kv", [3, 4, 12], timeout_s=5)
            check_pulled(target, "kv", KV, [7, 8, 1], [3, 4, 12])
            assert sample("triptych_worker_transfer_bytes_total", **labels) - before == moved
            assert wait_until(lambda: handle["lease_id"] in source.released())
            # TCP cannot wait on the event loop: pull_async runs the pull in a worker thread.
            again = source.offer("kv", [2], ttl_s=30)
            phases: dict[str, float] = {}
            assert asyncio.run(target.pull_async(again, "kv", [9], timeout_s=5, phases=phases)) == moved // 3
            check_pulled(target, "kv", KV, [2], [9])
            assert phases["dispatch"] > 0 and phases["resume"] > 0
            # The source serves live leases only (tests/worker/test_transfer_leases.py).
            with pytest.raises(TransferError, match="no such lease"):
                target.pull(handle, "kv", [3, 4, 12], timeout_s=5)
