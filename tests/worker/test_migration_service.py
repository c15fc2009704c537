"""The migration service (HydraInfer §4.3 pull-based hand-offs) between two instances'
services in one process, each over its own real NIXL agent (UCX, loopback) and a fake
block store holding real cache tensors: offer -> pull -> confirm -> free, lease expiry,
cancel, failures that free what was reserved, and the typed errors' statuses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import torch
from fastapi.testclient import TestClient
from polling import eventually
from prometheus_client import REGISTRY

from triptych.stage_protocol import KVSource, MMSource
from triptych.worker.auth import WorkerAuth
from triptych.worker.engine.kv_cache import OutOfBlocksError
from triptych.worker.engine.request import RequestOutput, RequestValidationError
from triptych.worker.errors import (
    BadPayloadError,
    NotServingError,
    engine_failure_status,
    http_status,
)
from triptych.worker.migration import (
    BadHandleError,
    HandoffExpiredError,
    LeaseTable,
    MigrationService,
    NoFreeBlocksError,
    PullFailedError,
    pull_errors,
    run_lease_pump,
)
from triptych.worker.server import create_app
from triptych.worker.settings import WorkerSettings
from triptych.worker.transfer import TransferEngine
from triptych.worker.transfer.base import IncompatibleHandleError, LeaseExpiredError, TransferError

KV_SHAPE = (12, 2, 2, 4, 2, 8)  # [blocks, layers, k/v, block_size, kv_heads, head_dim]
MM_SHAPE = (10, 4, 32)  # [blocks, rows_per_block, hidden]
ROWS = MM_SHAPE[1]


@dataclass(eq=False)
class Entry:
    content_hash: str
    block_ids: list[int]
    committed: bool = False


@dataclass
class FakeStore:
    """The engine's block API over two real tensors, recording every call."""

    kv: torch.Tensor
    mm: torch.Tensor
    free_kv_ids: list[int] = field(default_factory=list)
    free_mm_ids: list[int] = field(default_factory=list)
    held: dict[str, Entry] = field(default_factory=dict)
    calls: list[tuple[str, object]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Reversed free lists: reserved ids are neither contiguous with the source's nor ordered.
        self.free_kv_ids = list(range(self.kv.shape[0]))[::-1]
        self.free_mm_ids = list(range(self.mm.shape[0]))[::-1]

    def reserve_kv(self, num_tokens: int) -> list[int]:
        need = -(-num_tokens // KV_SHAPE[3])
        if need > len(self.free_kv_ids):
            raise OutOfBlocksError(f"asked for {need} blocks, {len(self.free_kv_ids)} free")
        ids = [self.free_kv_ids.pop() for _ in range(need)]
        self.calls.append(("reserve_kv", ids))
        return ids

    def free_kv(self, block_ids: list[int]) -> None:
        self.calls.append(("free_kv", list(block_ids)))
        self.free_kv_ids.extend(block_ids)

    def acquire_mm(self, content_hash: str) -> Entry | None:
        entry = self.held.get(content_hash)
        self.calls.append(("acquire_mm", content_hash))
        return entry

    def reserve_mm(self, content_hash: str, num_rows: int) -> Entry:
        need = -(-num_rows // ROWS)
        if need > len(self.free_mm_ids):
            raise OutOfBlocksError(f"MM cache: {need} blocks needed")
        entry = Entry(content_hash, [self.free_mm_ids.pop() for _ in range(need)])
        self.calls.append(("reserve_mm", entry.block_ids))
        return entry

    def commit_mm(self, entry: Entry) -> None:
        entry.committed = True
        self.calls.append(("commit_mm", entry.content_hash))

    def release_mm(self, entry: Entry) -> None:
        self.calls.append(("release_mm", entry.content_hash))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@dataclass
class Side:
    store: FakeStore
    transfer: TransferEngine
    service: MigrationService


def make_side(name: str, *, lease_seconds: float = 30.0, seed: int | None = None) -> Side:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    kv = torch.randn(KV_SHAPE, generator=gen) if gen else torch.zeros(KV_SHAPE)
    mm = torch.randn(MM_SHAPE, generator=gen) if gen else torch.zeros(MM_SHAPE)
    store = FakeStore(kv, mm)
    transfer = TransferEngine(name, require="nixl")
    transfer.register("kv", kv)
    transfer.register("mm", mm)
    service = MigrationService(store, transfer, lease_seconds=lease_seconds, pull_timeout_s=5.0)
    return Side(store, transfer, service)


@pytest.fixture
async def sides() -> AsyncIterator[tuple[Side, Side]]:
    source, target = make_side("mig-src", seed=11), make_side("mig-dst")
    source.service.start()
    target.service.start()
    try:
        yield source, target
    finally:
        for side in (source, target):
            side.service.stop()
            side.transfer.close()



def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- offer -> pull -> confirm -> free -----------------------------------------------------


async def test_kv_handoff_moves_the_source_blocks_and_frees_them_once(sides: tuple[Side, Side]) -> None:
    source, target = sides
    src_ids, num_tokens = [7, 2, 3], 10  # 10 tokens at 4 per block: 3 blocks
    pulls_before = sample("triptych_worker_migration_seconds_count", kind="pd", transport="nixl-ucx")
    kv = source.service.offer_kv("req-kv", src_ids, num_tokens, first_token=42)
    assert (kv.num_tokens, kv.first_token) == (num_tokens, 42)
    assert source.service.leases.outstanding() == 1 and source.store.released == []

    dst_ids = await target.service.pull_kv(KVSource.model_validate(kv.model_dump(mode="json")))

    assert len(dst_ids) == 3 and dst_ids != src_ids
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(target.store.kv[d], source.store.kv[s]), f"block {d} != source block {s}"
    block_bytes = source.store.kv[0].numel() * 4
    assert target.service.bytes_pulled == {"nixl-ucx": 3 * block_bytes}
    assert sample("triptych_worker_migration_seconds_count", kind="pd", transport="nixl-ucx") == pulls_before + 1
    assert await eventually(lambda: source.store.released == ["req-kv"])
    assert source.service.leases.outstanding() == 0
    await asyncio.sleep(0.1)
    assert source.store.released == ["req-kv"]  # exactly once
    assert "free_kv" not in target.store.names()


async def test_embedding_handoff_pulls_what_is_missing_and_frees_after_the_last(sides: tuple[Side, Side]) -> None:
    source, target = sides
    mm = [("hash-a", [4, 5], 2 * ROWS), ("hash-b", [9], ROWS - 1)]
    items = source.service.offer_embeddings("req-mm", mm)
    assert [(i.content_hash, i.num_tokens) for i in items] == [("hash-a", 2 * ROWS), ("hash-b", ROWS - 1)]
    assert source.service.leases.outstanding() == 2

    # hash-b is already cached on the target: confirmed without a READ or a reservation.
    target.store.held["hash-b"] = Entry("hash-b", [0], committed=True)
    sources = [MMSource(content_hash=i.content_hash, num_tokens=i.num_tokens, handle=i.handle) for i in items]
    entries = await target.service.pull_embeddings(sources)

    assert [e.content_hash for e in entries] == ["hash-a", "hash-b"]
    pulled = entries[0]
    assert pulled.committed and len(pulled.block_ids) == 2
    for s, d in zip([4, 5], pulled.block_ids, strict=True):
        assert torch.equal(target.store.mm[d], source.store.mm[s])
    assert target.store.names().count("reserve_mm") == 1
    assert target.service.bytes_pulled == {"nixl-ucx": 2 * source.store.mm[0].numel() * 4}
    assert await eventually(lambda: source.service.leases.outstanding() == 0)
    assert source.store.released == ["req-mm"]  # one release for the request, after both leases

    target.service.release_embeddings(entries)
    assert target.store.names()[-2:] == ["release_mm", "release_mm"]


async def test_unpulled_lease_expires_and_frees_exactly_once() -> None:
    source = make_side("mig-exp", lease_seconds=0.3, seed=1)
    source.service.start()
    try:
        before = sample("triptych_worker_lease_expired_total", region="kv")
        offered = time.monotonic()
        source.service.offer_kv("req-exp", [1], 4, first_token=0)
        assert await eventually(lambda: source.store.released == ["req-exp"])
        assert time.monotonic() - offered >= 0.3
        assert sample("triptych_worker_lease_expired_total", region="kv") == before + 1
        assert source.service.cancel("req-exp") == 0
        await asyncio.sleep(0.1)
        assert source.store.released == ["req-exp"]
    finally:
        source.service.stop()
        source.transfer.close()


async def test_cancel_frees_now_and_a_late_confirmation_is_ignored(sides: tuple[Side, Side]) -> None:
    source, target = sides
    kv = source.service.offer_kv("req-cancel", [0, 1], 8, first_token=1)
    source.service.offer_kv("other", [6], 4, first_token=1)
    assert source.service.cancel("req-cancel") == 1
    assert source.store.released == ["req-cancel"]
    assert source.service.leases.outstanding() == 1  # the other request's lease stays
    assert source.service.cancel("req-cancel") == 0

    await target.service.pull_kv(kv)  # the late pull still confirms; nothing is freed twice
    await asyncio.sleep(0.2)
    assert source.store.released == ["req-cancel"]


# -- failures free what was reserved --------------------------------------------------------


async def test_failed_kv_pull_frees_the_reserved_blocks(sides: tuple[Side, Side]) -> None:
    source, target = sides
    kv = source.service.offer_kv("req-fail", [3, 4], 8, first_token=1)
    broken = kv.model_copy(update={"handle": {**kv.handle, "agent_metadata": "***"}})
    with pytest.raises(PullFailedError, match="pulling pd blocks failed"):
        await target.service.pull_kv(broken)
    (reserve, free) = target.store.calls
    assert reserve[0] == "reserve_kv" and free == ("free_kv", reserve[1])
    assert len(target.store.free_kv_ids) == KV_SHAPE[0]


async def test_failed_embedding_pull_releases_every_entry_taken(sides: tuple[Side, Side]) -> None:
    source, target = sides
    good, bad = source.service.offer_embeddings("req-mmfail", [("h1", [1], ROWS), ("h2", [2], ROWS)])
    target.store.held["h1"] = Entry("h1", [0], committed=True)
    sources = [MMSource(content_hash=good.content_hash, num_tokens=good.num_tokens, handle=good.handle),
               MMSource(content_hash=bad.content_hash, num_tokens=bad.num_tokens,
                        handle={**bad.handle, "agent_metadata": "***"})]
    with pytest.raises(PullFailedError):
        await target.service.pull_embeddings(sources)
    assert target.store.names() == ["acquire_mm", "acquire_mm", "reserve_mm", "release_mm", "release_mm"]


async def test_incompatible_handle_is_a_bad_handle_and_frees(sides: tuple[Side, Side]) -> None:
    source, target = sides
    kv = source.service.offer_kv("req-layout", [0], 4, first_token=1)
    wrong = kv.model_copy(update={"handle": {**kv.handle, "dtype": "float16"}})
    with pytest.raises(BadHandleError, match="block layout differs"):
        await target.service.pull_kv(wrong)
    assert target.store.names() == ["reserve_kv", "free_kv"]


async def test_malformed_handle_is_refused_before_reserving(sides: tuple[Side, Side]) -> None:
    _, target = sides
    with pytest.raises(BadHandleError, match="malformed block handle"):
        await target.service.pull_kv(KVSource(handle={"region": "kv"}, num_tokens=4, first_token=0))
    assert target.store.calls == []


async def test_no_room_is_a_typed_error(sides: tuple[Side, Side]) -> None:
    source, target = sides
    kv = source.service.offer_kv("req-big", [0], 4, first_token=1)
    with pytest.raises(NoFreeBlocksError, match="no room"):
        await target.service.pull_kv(kv.model_copy(update={"num_tokens": 4 * (KV_SHAPE[0] + 1)}))
    item = source.service.offer_embeddings("req-bigmm", [("hx", [0], ROWS)])[0]
    with pytest.raises(NoFreeBlocksError):
        await target.service.pull_embeddings([MMSource(content_hash="hx", num_tokens=ROWS * 11, handle=item.handle)])


# -- statuses -------------------------------------------------------------------------------


@pytest.mark.parametrize(("exc", "status"), [
    (RequestValidationError("prompt too long"), 400),
    (BadPayloadError("not base64"), 400),
    (BadHandleError("layout differs"), 400),
    (NoFreeBlocksError("no room"), 503),
    (NotServingError("draining"), 503),
    (PullFailedError("peer gone"), 502),
    (TimeoutError(), 504),
    (RuntimeError("KV cache exhausted"), 500),  # text never decides
])
def test_typed_errors_map_to_statuses(exc: BaseException, status: int) -> None:
    assert http_status(exc) == status


def test_engine_failures_after_admission_are_5xx() -> None:
    def failed(error: str) -> RequestOutput:
        return RequestOutput(request_id="r", new_token_ids=[], finished=True, error=error)

    assert engine_failure_status(failed("KV cache exhausted")) == 503
    assert engine_failure_status(failed("RuntimeError: boom")) == 500


def test_unassigned_worker_refuses_a_stage_run_with_503() -> None:
    app = create_app(WorkerSettings(model="unused", instance_id="w-test"), WorkerAuth.open())
    with TestClient(app) as client:
        r = client.post("/internal/run", json={"request_id": "r1", "stages": ["prefill"], "prompt_token_ids": [1]})
    assert r.status_code == 503
    assert r.json() == {"error": {"message": "instance w-test is unassigned; not accepting work", "code": 503}}


# -- the lease pump -------------------------------------------------------------------------


class CountingNotifications:
    def __init__(self) -> None:
        self.polls = 0
        self.pending: list[tuple[str, str]] = []

    def poll_notifications(self) -> list[tuple[str, str]]:
        self.polls += 1
        out, self.pending = self.pending, []
        return out


async def test_lease_pump_sleeps_while_no_lease_is_outstanding() -> None:
    notes, table, freed = CountingNotifications(), LeaseTable(), []
    pump = asyncio.create_task(run_lease_pump(notes, table, interval_s=0.005, max_interval_s=0.02))
    try:
        await asyncio.sleep(0.3)
        assert notes.polls == 0  # idle: no polling at all

        lease = table.offer("kv", [1], lambda: freed.append(1), ttl_s=30)
        await asyncio.sleep(0.3)
        # Outstanding: polled, at most every 5 ms backing off to 20 ms (0.3 s -> ~20 polls).
        assert 1 <= notes.polls <= 0.3 / 0.005
        notes.pending.append((lease.lease_id, "wrong secret"))
        await asyncio.sleep(0.1)
        assert freed == []  # a confirmation without the lease's secret frees nothing
        notes.pending.append((lease.lease_id, lease.secret))
        assert await eventually(lambda: freed == [1], timeout_s=2)

        await asyncio.sleep(0.05)
        idle_polls = notes.polls
        await asyncio.sleep(0.3)
        assert notes.polls == idle_polls  # idle again
    finally:
        pump.cancel()


async def test_lease_pump_wakes_for_an_offer_from_another_thread() -> None:
    notes, table, freed = CountingNotifications(), LeaseTable(), []
    pump = asyncio.create_task(run_lease_pump(notes, table))
    try:
        await asyncio.sleep(0.05)
        await asyncio.to_thread(table.offer, "mm", [0], lambda: freed.append(1), 0.1)
        assert await eventually(lambda: freed == [1], timeout_s=2)
    finally:
        pump.cancel()


def test_the_engine_is_a_block_store() -> None:
    """InstanceRuntime hands its Engine to the service as the BlockStore: same names, same
    parameters (a rename in the engine must fail here, not mid-hand-off)."""
    import inspect

    from triptych.worker.engine import Engine
    from triptych.worker.migration import BlockStore

    members = [n for n in vars(BlockStore) if not n.startswith("_")]
    assert sorted(members) == ["acquire_mm", "cache_kv", "commit_mm", "free_kv", "kv_block_hashes", "release",
                               "release_mm", "reserve_kv", "reserve_kv_cached", "reserve_mm"]
    for name in members:
        want = list(inspect.signature(getattr(BlockStore, name)).parameters)
        assert list(inspect.signature(getattr(Engine, name)).parameters) == want, name


@pytest.mark.parametrize(("raised", "want", "text"), [
    (IncompatibleHandleError, BadHandleError, "video part 3: handle does not fit this instance"),
    (LeaseExpiredError, HandoffExpiredError, "video part 3: hand-off expired"),
    (TransferError, PullFailedError, "pulling video part 3 failed"),
])
def test_pull_errors_turns_transfer_failures_into_handoff_failures(raised, want, text) -> None:
    """The one translation both pullers use (the migration service, worker/video_pull.py)."""
    with pytest.raises(want, match=text) as info, pull_errors("video part 3"):
        raise raised("peer said no")
    assert isinstance(info.value.__cause__, raised) and "peer said no" in str(info.value)
