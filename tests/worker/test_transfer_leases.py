"""Transfers bound to leases, over the TCP fallback between two processes: a peer reads
only the blocks of a lease offered to it, with the lease's secret, while the lease is
live; and a pull that cannot finish before the lease ends is refused before it reads."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from polling import wait_until

from triptych.worker.errors import http_status
from triptych.worker.migration import HandoffExpiredError, MigrationService
from triptych.worker.transfer import TransferEngine, TransferError
from triptych.worker.transfer.base import LeaseExpiredError
from triptych.worker.transfer.loopback import RegionSpec, SourcePeer, pattern
from triptych.worker.transfer.tcp import TcpBackend, bind_and_advertise

KV = RegionSpec((12, 2, 4, 8), "float32", seed=3)
NO_NIXL = "NO_SUCH_PLUGIN"  # forces the TCP fallback on both sides


@pytest.fixture(scope="module")
def source() -> Iterator[SourcePeer]:
    with SourcePeer({"kv": KV}, name="lease-src", require="any", nixl_plugin=NO_NIXL) as peer:
        assert peer.transport == "tcp"
        yield peer


@pytest.fixture(scope="module")
def target() -> Iterator[TransferEngine]:
    with TransferEngine("lease-dst", require="any", nixl_plugin=NO_NIXL) as engine:
        assert engine.transport == "tcp"
        engine.register("kv", torch.zeros(KV.shape, dtype=torch.float32))
        yield engine


def local(engine: TransferEngine) -> torch.Tensor:
    return engine._regions["kv"].tensor


def test_a_leased_read_works_once_then_not_after_confirm(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("kv", [4, 5, 9], ttl_s=30)
    assert "base_addr" in handle and handle["block_ids"] == [4, 5, 9] and handle["lease_secret"]
    target.pull(handle, "kv", [0, 1, 2], timeout_s=5)
    assert torch.equal(local(target)[[0, 1, 2]], pattern(KV)[[4, 5, 9]])
    assert wait_until(lambda: handle["lease_id"] in source.released())
    local(target).zero_()
    with pytest.raises(TransferError, match="no such lease"):
        target.pull(handle, "kv", [0, 1, 2], timeout_s=5)
    assert not local(target).any()


def test_a_read_outside_the_leased_blocks_is_refused(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("kv", [4, 5], ttl_s=30)
    for block_ids in ([3], [6], [4, 5, 6], [11]):  # neighbours, a longer run, far away
        with pytest.raises(TransferError, match="outside the leased blocks"):
            target.pull({**handle, "block_ids": block_ids}, "kv", list(range(len(block_ids))), timeout_s=5,
                        notify=False)
    forged = {**handle, "base_addr": handle["base_addr"] - KV.shape[1] * 4 * 64}  # shifted addresses
    with pytest.raises(TransferError, match="outside the leased blocks"):
        target.pull(forged, "kv", [0, 1], timeout_s=5, notify=False)
    assert not local(target).any()
    target.pull(handle, "kv", [0, 1], timeout_s=5)  # the lease itself still reads
    local(target).zero_()


def test_a_read_without_the_lease_or_its_secret_is_refused(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("kv", [2], ttl_s=30)
    for forged in ({**handle, "lease_id": "no-such-lease"}, {**handle, "lease_secret": "guessed"}):
        with pytest.raises(TransferError, match="no such lease"):
            target.pull(forged, "kv", [0], timeout_s=5)
    assert not local(target).any()
    # A confirmation with the wrong secret did not release the lease.
    time.sleep(0.1)
    assert handle["lease_id"] not in source.released()
    target.pull(handle, "kv", [0], timeout_s=5)
    assert wait_until(lambda: handle["lease_id"] in source.released())
    local(target).zero_()


def test_a_read_after_expiry_is_refused_by_the_source(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("kv", [7], ttl_s=0.3)
    assert wait_until(lambda: handle["lease_id"] in source.released())  # expired and freed
    late = {**handle, "expires_at": time.time() + 60}  # a target that ignores the expiry
    with pytest.raises(TransferError, match="no such lease|expired"):
        target.pull(late, "kv", [0], timeout_s=5)
    assert not local(target).any()


def test_a_pull_too_late_to_finish_before_expiry_is_refused(source: SourcePeer, target: TransferEngine) -> None:
    handle = source.offer("kv", [8], ttl_s=30)
    for expires_in in (-1.0, 0.01):  # past, or too close to read anything
        with pytest.raises(LeaseExpiredError):
            target.pull({**handle, "expires_at": time.time() + expires_in}, "kv", [0], timeout_s=5)
    assert not local(target).any()
    assert handle["lease_id"] not in source.released()  # nothing read, nothing confirmed


def test_the_handle_expires_a_margin_before_the_source_frees(source: SourcePeer) -> None:
    before = time.time()
    handle = source.offer("kv", [1], ttl_s=10, margin_s=2)
    assert before + 8 - 0.5 <= handle["expires_at"] <= time.time() + 8


class _Store:
    def reserve_kv(self, num_tokens: int) -> list[int]:
        return [0]

    def free_kv(self, block_ids: list[int]) -> None:
        self.freed = block_ids


async def test_an_expired_hand_off_is_a_retriable_refusal(source: SourcePeer, target: TransferEngine) -> None:
    from triptych.stage_protocol import KVSource

    handle = source.offer("kv", [3], ttl_s=30)
    store = _Store()
    service = MigrationService(store, target, lease_seconds=30, pull_timeout_s=5)  # type: ignore[arg-type]
    src = KVSource(handle={**handle, "expires_at": time.time()}, num_tokens=1, first_token=0)
    with pytest.raises(HandoffExpiredError) as info:
        await service.pull_kv(src)
    assert http_status(info.value) == 503 and store.freed == [0]
    assert not local(target).any()


def test_tcp_fallback_advertises_a_routable_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIPTYCH_TRANSFER_HOST", raising=False)
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert bind_and_advertise(None) == ("0.0.0.0", "10.1.2.3")
    assert bind_and_advertise("127.0.0.1") == ("127.0.0.1", "127.0.0.1")  # a loopback bind stays local
    assert bind_and_advertise("192.0.2.7") == ("192.0.2.7", "192.0.2.7")
    monkeypatch.delenv("POD_IP")
    assert bind_and_advertise(None) == ("127.0.0.1", "127.0.0.1")
    bind, advertised = bind_and_advertise("0.0.0.0")
    assert bind == "0.0.0.0" and advertised not in ("0.0.0.0", "")
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    backend = TcpBackend("adv-test")
    try:
        assert b'"host": "10.1.2.3"' in backend.metadata()
    finally:
        backend.close()
