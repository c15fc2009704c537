"""The instance's abort withdraws a hand-over it offered: the engine aborts the request and
its leases are released now, once, not at expiry."""

from __future__ import annotations

from types import SimpleNamespace

from triptych.worker.instance import InstanceRuntime
from triptych.worker.migration import MigrationService
from triptych.worker.settings import WorkerSettings
from triptych.worker.transfer import BlockHandle


class FakeTransfer:
    transport = "fake"

    def __init__(self) -> None:
        self.revoked: list[str] = []

    def handle(self, region: str, block_ids: list[int], lease_id: str, *, secret: str, ttl_s: float,
               margin_s: float = 0.0) -> BlockHandle:
        return BlockHandle(transport="fake", agent_name="a", agent_metadata="", region=region, mem_type="DRAM",
                           device_id=0, base_addr=0, block_nbytes=8, num_blocks=16, block_ids=block_ids,
                           lease_id=lease_id, lease_secret=secret, expires_at=0.0, dtype="float32",
                           block_shape=[2])

    def revoke(self, lease_id: str) -> None:
        self.revoked.append(lease_id)

    def poll_notifications(self) -> list[tuple[str, str]]:
        return []


def test_abort_cancels_the_requests_leases() -> None:
    calls: list[tuple[str, str]] = []
    engine = SimpleNamespace(abort=lambda rid: calls.append(("abort", rid)),
                             release=lambda rid: calls.append(("release", rid)))
    inst = InstanceRuntime(WorkerSettings(model="unused"))
    inst.engine = engine  # type: ignore[assignment]
    transfer = FakeTransfer()
    inst.migration = MigrationService(engine, transfer, lease_seconds=30, pull_timeout_s=5)  # type: ignore[arg-type]
    items = inst.migration.offer_embeddings("r1", [("h1", [1], 2), ("h2", [2, 3], 4)])
    inst.migration.offer_kv("r2", [5], 4, first_token=0)
    assert inst.leases_outstanding() == 3

    inst.abort("r1")
    assert calls == [("abort", "r1"), ("release", "r1")]  # both leases gone, the request released once
    assert sorted(transfer.revoked) == sorted(i.handle["lease_id"] for i in items)  # no more reads under them
    assert inst.leases_outstanding() == 1
    inst.abort("r1")
    assert calls[-1] == ("abort", "r1") and calls.count(("release", "r1")) == 1
    inst.engine = None
    assert inst.stats()["leases_outstanding"] == 1
