"""One instance's side of pull-based migration (HydraInfer §4.3), for both hand-offs:
E->P embeddings into MM blocks and P->D KV blocks.

Source: `offer_embeddings` / `offer_kv` put a parked request's blocks under leases and
return what the next stage needs (handles, opaque to the router); when every lease of
the request is confirmed, expired or cancelled, the store releases the request (its
blocks are freed). Target: `pull_embeddings` / `pull_kv` reserve local blocks, READ the
source's blocks into them and confirm the leases; on any failure the reserved blocks are
freed. The service moves blocks through a `BlockTransfer` (the transfer engine over NIXL
or the TCP fallback) into and out of a `BlockStore` (the engine's public block API).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from triptych.prefix_hash import BlockHash, PlaceholderRun
from triptych.stage_protocol import EncodedItem, KVSource, MMSource
from triptych.timings import TIMINGS, TimingRing
from triptych.worker.engine.kv_cache import OutOfBlocksError
from triptych.worker.migration.errors import BadHandleError, NoFreeBlocksError, pull_errors
from triptych.worker.migration.leases import Lease, LeaseTable, run_lease_pump
from triptych.worker.transfer.base import BlockHandle, registry_metric

log = logging.getLogger(__name__)

MIGRATION_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_migration_seconds",
    "Time to pull a request's blocks from the previous stage's instance (EP: embeddings, PD: KV)",
    ["kind", "transport"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
MIGRATION_PHASE_SECONDS: Histogram = registry_metric(
    Histogram, "triptych_worker_migration_phase_seconds",
    "Parts of a pull on the target: reserve (local blocks), dispatch (to a transfer thread; 0 for NIXL, "
    "which waits on the event loop), prepare (handle checks, peer metadata), read (the READ), confirm (the "
    "lease notification), resume (back on the event loop after a transfer thread)",
    ["kind", "phase"], buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1))


PRECOPY_OWNER_SUFFIX = "#precopy"  # a pre-copy lease's owner: the request id + this (never cancelled)

KV_BLOCKS_REUSED: Counter = registry_metric(
    Counter, "triptych_worker_kv_blocks_reused",
    "Prefilled KV blocks a decode instance took from its own prefix cache instead of pulling them", [])


class MMBlocks(Protocol):
    """An embedding's entry in the MM cache (the engine's `MMEntry`)."""

    block_ids: list[int]


class BlockStore(Protocol):
    """The engine's block API, as migration uses it (`Engine` satisfies it)."""

    def reserve_kv(self, num_tokens: int) -> list[int]: ...
    def kv_block_hashes(self, token_ids: Sequence[int], mm_items: Sequence[PlaceholderRun],
                        num_tokens: int) -> list[BlockHash]: ...
    def reserve_kv_cached(self, num_tokens: int, hashes: list[BlockHash]) -> tuple[list[int], int]: ...
    def cache_kv(self, block_ids: list[int], hashes: list[BlockHash]) -> None: ...
    def free_kv(self, block_ids: list[int]) -> None: ...
    def acquire_mm(self, content_hash: str) -> MMBlocks | None: ...
    def reserve_mm(self, content_hash: str, num_rows: int) -> MMBlocks: ...
    # Any: the engine's methods take its own entry type (a narrower parameter than MMBlocks).
    def commit_mm(self, entry: Any) -> None: ...
    def release_mm(self, entry: Any) -> None: ...
    def release(self, request_id: str) -> None: ...


class BlockTransfer(Protocol):
    """Moving blocks of registered regions between instances (`TransferEngine`)."""

    transport: str

    def handle(self, region: str, block_ids: list[int], lease_id: str, *, secret: str, ttl_s: float,
               margin_s: float = 0.0) -> BlockHandle: ...
    def revoke(self, lease_id: str) -> None: ...
    def pull(self, handle: BlockHandle | dict[str, Any], local_region: str, local_block_ids: list[int], *,
             timeout_s: float, notify: bool = True, phases: dict[str, float] | None = None) -> int: ...
    async def pull_async(self, handle: BlockHandle | dict[str, Any], local_region: str, local_block_ids: list[int],
                         *, timeout_s: float, notify: bool = True, phases: dict[str, float] | None = None
                         ) -> int: ...
    def poll_notifications(self) -> list[tuple[str, str]]: ...


class MigrationService:
    """Offer -> pull -> confirm -> free for one instance's role (rebuilt on a switch)."""

    def __init__(self, store: BlockStore, transfer: BlockTransfer, *, lease_seconds: float,
                 pull_timeout_s: float, bytes_pulled: dict[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic, lease_margin_s: float = 1.0,
                 timings: TimingRing = TIMINGS) -> None:
        # Keep pull_timeout_s below the sources' lease TTL: a source must not free (and reuse)
        # blocks while a target is still reading them (the CLI derives one from the other).
        if pull_timeout_s <= 0 or lease_seconds <= 0:
            raise ValueError(f"need pull_timeout_s, lease_seconds > 0, got {pull_timeout_s}, {lease_seconds}")
        self.store, self.transfer = store, transfer
        self.lease_seconds, self.pull_timeout_s = lease_seconds, pull_timeout_s
        # Handles tell targets to finish this long before the source frees (clock skew, the
        # pump's release latency); at most a quarter of the lease.
        self.lease_margin_s = min(lease_margin_s, lease_seconds / 4)
        # Every release (confirm, expiry, cancel) also ends the lease's read grant.
        self.leases = LeaseTable(clock, on_any_release=lambda lease: transfer.revoke(lease.lease_id))
        self.bytes_pulled = {} if bytes_pulled is None else bytes_pulled  # transport -> bytes
        self.timings = timings  # each pull's phases, exact (bench serve reads them)
        self._pump: asyncio.Task[None] | None = None

    @property
    def transport(self) -> str:
        return self.transfer.transport

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the lease pump on the running event loop."""
        if self._pump is None:
            self._pump = asyncio.create_task(run_lease_pump(self.transfer, self.leases))

    def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None

    def free_all(self) -> int:
        """Release every outstanding lease now (a drain that timed out); returns how many."""
        return len(self.leases.expire(now=float("inf")))

    # -- source side ---------------------------------------------------------------------
    def offer_embeddings(self, request_id: str, mm: list[tuple[str, list[int], int]]) -> list[EncodedItem]:
        """Offer each (content_hash, block_ids, rows) of an encoded request; one lease each."""
        leases = self._offer(request_id, "mm", [ids for _, ids, _ in mm])
        return [EncodedItem(content_hash=h, num_tokens=rows, handle=self._handle("mm", ids, lease))
                for (h, ids, rows), lease in zip(mm, leases, strict=True)]

    def offer_kv(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int) -> KVSource:
        """Offer a prefilled request's KV blocks (and the token it sampled) under one lease."""
        (lease,) = self._offer(request_id, "kv", [block_ids])
        handle = self._handle("kv", block_ids, lease)
        return KVSource(handle=handle, num_tokens=num_tokens, first_token=first_token)

    def offer_precopy(self, request_id: str, held: Any) -> KVSource:
        """Offer a running decode's full KV blocks for a pre-copy (live migration): `held`
        is the engine's `HeldKV` — its references keep the blocks valid while the decode
        goes on (or ends), and the lease owns them from here: confirm, expiry (or
        `free_all`) releases them. Not cancelled with the request: a target may be reading
        them into its prefix cache, and what it caches must be what it read."""
        lease = self.leases.offer("kv", held.block_ids, held.release, self.lease_seconds,
                                  owner=request_id + PRECOPY_OWNER_SUFFIX)
        handle = self._handle("kv", held.block_ids, lease)
        generated = held.tokens[held.num_prompt_tokens:held.num_tokens]
        return KVSource(handle=handle, num_tokens=held.num_tokens, first_token=held.tokens[held.num_tokens],
                        generated=generated)

    def precopies_outstanding(self, live: Collection[str] | None = None) -> int:
        """Pre-copy leases no target has confirmed yet (nor expired); with `live`, only those
        of these requests (a decode that ended meanwhile is never pulled, and its lease
        stays until it expires: nothing to wait for)."""
        owners = None if live is None else {rid + PRECOPY_OWNER_SUFFIX for rid in live}
        return self.leases.outstanding(owner_suffix=PRECOPY_OWNER_SUFFIX, owners=owners)

    def cancel(self, request_id: str) -> int:
        """The request was aborted: release its leases now (late pulls find nothing held)."""
        return self.leases.cancel_owner(request_id)

    def _handle(self, region: str, block_ids: list[int], lease: Lease) -> dict[str, Any]:
        return self.transfer.handle(region, block_ids, lease.lease_id, secret=lease.secret, ttl_s=lease.ttl_s,
                                    margin_s=self.lease_margin_s).model_dump(mode="json")

    def _offer(self, request_id: str, region: str, groups: list[list[int]]) -> list[Lease]:
        """One lease per group; the store releases the request when all are done."""
        remaining, lock = [len(groups)], threading.Lock()

        def release_one() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.store.release(request_id)

        return [self.leases.offer(region, ids, release_one, self.lease_seconds, owner=request_id)
                for ids in groups]

    # -- target side ---------------------------------------------------------------------
    async def pull_embeddings(self, sources: list[MMSource]) -> list[Any]:
        """Pull each embedding into the MM cache, skipping (but confirming) ones already
        held. Returns the MM entries to `release_embeddings` once the request holds its own
        references; on failure every entry taken so far is released."""
        taken: list[Any] = []
        try:
            for src in sources:
                handle = _parse(src.handle)
                held = self.store.acquire_mm(src.content_hash)
                if held is not None:
                    taken.append(held)
                    await self._pull(handle.model_copy(update={"block_ids": []}), "mm", [], "ep")  # confirm only
                    continue
                try:
                    entry = self.store.reserve_mm(src.content_hash, src.num_tokens)
                except OutOfBlocksError as exc:
                    raise NoFreeBlocksError(f"no room for embedding {src.content_hash[:16]}: {exc}") from exc
                taken.append(entry)
                await self._pull(handle, "mm", entry.block_ids, "ep")
                self.store.commit_mm(entry)
        except BaseException:
            self.release_embeddings(taken)
            raise
        return taken

    def release_embeddings(self, entries: list[Any]) -> None:
        for entry in entries:
            self.store.release_mm(entry)

    async def pull_kv(self, src: KVSource, token_ids: Sequence[int] = (),
                      mm_items: Sequence[PlaceholderRun] = ()) -> list[int]:
        """Reserve KV blocks for a prefilled request and pull them; returns the block ids
        (the request owns them from here). Freed again if the pull fails.

        With the request's prompt (`token_ids`, `mm_items`) the leading full blocks this
        instance's prefix cache already holds (the same hash chain: same tokens, same
        images) are taken from it and not pulled: only the rest of the blocks cross the
        wire (the lease is confirmed all the same). The pulled full blocks join the prefix
        cache, so the next hand-over of the same prefix skips them too."""
        block_ids, _ = await self._pull_kv(src, token_ids, mm_items)
        return block_ids

    async def _pull_kv(self, src: KVSource, token_ids: Sequence[int],
                       mm_items: Sequence[PlaceholderRun]) -> tuple[list[int], int]:
        """`pull_kv`, also saying how many leading blocks the prefix cache held."""
        started = time.monotonic()
        handle = _parse(src.handle)
        prompt_tokens = min(src.num_tokens, len(token_ids))
        hashes = self.store.kv_block_hashes(token_ids, mm_items, prompt_tokens) if token_ids else []
        hashes = hashes[:len(handle.block_ids)]
        try:
            block_ids, held = (self.store.reserve_kv_cached(src.num_tokens, hashes) if hashes
                               else (self.store.reserve_kv(src.num_tokens), 0))
        except OutOfBlocksError as exc:
            raise NoFreeBlocksError(f"no room for {src.num_tokens} tokens of prefilled KV: {exc}") from exc
        if held:
            KV_BLOCKS_REUSED.inc(held)
        try:
            rest = handle.model_copy(update={"block_ids": handle.block_ids[held:]})
            await self._pull(rest, "kv", block_ids[held:], "pd", started)
        except BaseException:
            self.store.free_kv(block_ids)
            raise
        if hashes:
            self.store.cache_kv(block_ids[held:len(hashes)], hashes[held:])
        return block_ids, held

    async def precopy_kv(self, src: KVSource, token_ids: Sequence[int],
                         mm_items: Sequence[PlaceholderRun] = ()) -> tuple[int, int]:
        """Target side of a pre-copy: pull a running decode's full blocks (`src`: their
        tokens are `token_ids` + `src.generated`) into the prefix cache and let go of them
        there — cached, unreferenced, evictable like any cached prefix, so nothing can leak.
        The decode's hand-over then finds them (`pull_kv` with the same tokens) and pulls
        only the rest. Returns (blocks pulled, blocks already held)."""
        tokens = [*token_ids, *src.generated]
        if not self.store.kv_block_hashes(tokens, mm_items, src.num_tokens):  # no prefix cache here
            handle = _parse(src.handle)
            await self._pull(handle.model_copy(update={"block_ids": []}), "kv", [], "pd")  # confirm only
            return 0, 0
        # Shielded: a cancelled caller (the router gave up) must not free blocks a transfer
        # thread is still writing.
        block_ids, held = await asyncio.shield(self._pull_kv(src, tokens, mm_items))
        self.store.free_kv(block_ids)
        return len(block_ids) - held, held

    def discard_kv(self, block_ids: list[int]) -> None:
        """Free pulled KV blocks that no request took over (it was refused before the engine)."""
        self.store.free_kv(block_ids)

    async def _pull(self, handle: BlockHandle, region: str, block_ids: list[int], kind: str,
                    started: float | None = None) -> None:
        """Pull and confirm; `started` is when the caller began (before reserving blocks)."""
        dispatched = time.monotonic()
        started = dispatched if started is None else started
        phases: dict[str, float] = {"reserve": dispatched - started}
        with pull_errors(f"{kind} blocks"):
            nbytes = await self.transfer.pull_async(handle, region, block_ids, timeout_s=self.pull_timeout_s,
                                                    phases=phases)
        now = time.monotonic()
        seconds = now - started
        MIGRATION_SECONDS.labels(kind=kind, transport=self.transport).observe(seconds)
        for phase, value in phases.items():
            MIGRATION_PHASE_SECONDS.labels(kind=kind, phase=phase).observe(value)
        self.timings.record(kind, seconds, phases, nbytes)
        self.bytes_pulled[self.transport] = self.bytes_pulled.get(self.transport, 0) + nbytes


def _parse(raw: dict[str, Any]) -> BlockHandle:
    try:
        return BlockHandle.model_validate(raw)
    except ValidationError as exc:
        raise BadHandleError(f"malformed block handle: {exc.error_count()} error(s): {exc.errors()[0]['msg']}") \
            from exc
