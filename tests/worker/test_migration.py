"""Leases of pull-based migration (HydraInfer §4.3): free exactly once, on confirmation,
cancellation or TTL expiry; the lease pump against real NIXL notifications."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from polling import wait_until
from prometheus_client import REGISTRY

from triptych.worker.migration import LeaseTable, pump_once, run_lease_pump
from triptych.worker.transfer import TransferEngine
from triptych.worker.transfer.loopback import RegionSpec, SourcePeer, pattern

MM = RegionSpec((8, 4, 16), "float32", seed=3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def expired_total(region: str) -> float:
    return REGISTRY.get_sample_value("triptych_worker_lease_expired_total", {"region": region}) or 0.0




def test_confirm_releases_exactly_once() -> None:
    table, freed = LeaseTable(), []
    lease = table.offer("kv", [1, 2], lambda: freed.append("a"), ttl_s=10)
    assert table.outstanding() == 1
    assert table.confirm(lease.lease_id, lease.secret) is True
    assert table.confirm(lease.lease_id, lease.secret) is False
    assert table.cancel(lease.lease_id) is False
    assert table.expire(now=float("inf")) == []
    assert freed == ["a"] and table.outstanding() == 0


def test_cancel_releases_and_later_confirmation_is_ignored() -> None:
    table, freed = LeaseTable(), []
    lease = table.offer("mm", [0], lambda: freed.append(1), ttl_s=10)
    assert table.cancel(lease.lease_id) is True
    assert table.confirm(lease.lease_id, lease.secret) is False
    assert freed == [1]


def test_expire_frees_only_overdue_leases_and_counts_them() -> None:
    clock, freed = FakeClock(), []
    table = LeaseTable(clock=clock)
    short = table.offer("unit-expire", [1], lambda: freed.append("short"), ttl_s=1)
    long = table.offer("unit-expire", [2], lambda: freed.append("long"), ttl_s=5)
    before = expired_total("unit-expire")
    assert table.expire() == []
    clock.now += 1.0
    assert table.expire() == [short.lease_id]
    assert freed == ["short"] and table.outstanding() == 1
    assert expired_total("unit-expire") == before + 1
    assert table.expire(now=clock.now + 10) == [long.lease_id]
    assert expired_total("unit-expire") == before + 2
    assert table.confirm(short.lease_id, short.secret) is False  # a late confirmation after expiry is a no-op


def test_failing_on_release_is_logged_and_the_lease_is_gone(caplog: pytest.LogCaptureFixture) -> None:
    table = LeaseTable()

    def boom() -> None:
        raise RuntimeError("allocator broke")

    lease = table.offer("kv", [3], boom, ttl_s=10)
    with caplog.at_level(logging.ERROR):
        assert table.confirm(lease.lease_id, lease.secret) is True
    assert "on_release failed" in caplog.text and table.outstanding() == 0


def test_bad_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        LeaseTable().offer("kv", [0], lambda: None, ttl_s=0)


def test_racing_confirm_cancel_expire_free_each_lease_once() -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def freer(key: str) -> Callable[[], None]:
        def free() -> None:
            with lock:
                counts[key] = counts.get(key, 0) + 1
        return free

    leases = [table.offer("kv", [i], freer(str(i)), ttl_s=1) for i in range(300)]
    ids = [lease.lease_id for lease in leases]
    secrets = {lease.lease_id: lease.secret for lease in leases}
    clock.now += 2  # all overdue, so expire() races confirm/cancel on every lease
    start = threading.Barrier(4)

    def run(action: Callable[[str], object]) -> None:
        start.wait()
        for lid in ids:
            action(lid)

    threads = [threading.Thread(target=run, args=(a,)) for a in
               (lambda lid: table.confirm(lid, secrets[lid]), table.cancel, lambda _: table.expire(),
                lambda lid: table.confirm(lid, secrets[lid]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert counts == {str(i): 1 for i in range(300)}
    assert table.outstanding() == 0


async def test_run_lease_pump_expires_in_the_background() -> None:
    with TransferEngine("pump", require="nixl") as engine:
        table, freed = LeaseTable(), asyncio.Event()
        table.offer("mm", [0], freed.set, ttl_s=0.05)
        task = asyncio.create_task(run_lease_pump(engine, table, interval_s=0.01))
        try:
            await asyncio.wait_for(freed.wait(), timeout=5)
        finally:
            task.cancel()
        assert table.outstanding() == 0
        assert pump_once(engine, table) == 0


@pytest.fixture(scope="module")
def source() -> Iterator[SourcePeer]:
    with SourcePeer({"mm": MM}, name="lease-src", require="nixl") as peer:
        yield peer


def test_unconfirmed_lease_expires_on_the_source(source: SourcePeer) -> None:
    """Nobody pulls: the source's pump frees the blocks after the TTL and counts it."""
    before = source.expired_total("mm")
    handle = source.offer("mm", [4, 5], ttl_s=1.0)
    offered = time.monotonic()
    assert handle["lease_id"] not in source.released()
    assert wait_until(lambda: handle["lease_id"] in source.released())
    assert time.monotonic() - offered >= 1.0
    assert source.expired_total("mm") == before + 1


def test_confirmed_lease_is_freed_by_notification_not_expiry(source: SourcePeer) -> None:
    with TransferEngine("lease-dst", require="nixl") as target:
        target.register("mm", torch.zeros(MM.shape, dtype=torch.float32))
        before = source.expired_total("mm")
        handle = source.offer("mm", [7, 0], ttl_s=30)
        assert target.pull(handle, "mm", [1, 2], timeout_s=5) == 2 * 4 * 16 * 4
        assert torch.equal(target._regions["mm"].tensor[[1, 2]], pattern(MM)[[7, 0]])
        assert wait_until(lambda: handle["lease_id"] in source.released())
        assert source.released().count(handle["lease_id"]) == 1
        assert source.expired_total("mm") == before
        assert source.outstanding() == 0


def test_pull_without_notify_leaves_the_lease_to_expire(source: SourcePeer) -> None:
    with TransferEngine("lease-dst2", require="nixl") as target:
        target.register("mm", torch.zeros(MM.shape, dtype=torch.float32))
        before = source.expired_total("mm")
        handle = source.offer("mm", [3], ttl_s=2.0)
        target.pull(handle, "mm", [6], timeout_s=5, notify=False)
        assert handle["lease_id"] not in source.released()
        assert wait_until(lambda: handle["lease_id"] in source.released(), timeout_s=10)
        assert source.expired_total("mm") == before + 1
