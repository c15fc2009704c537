"""The transport-independent transfer engine: an instance's registered cache regions,
the handles it gives out for their blocks, and block READs from peers' regions.

HydraInfer §4.3's pull-based migration moves blocks with it (`triptych.worker.migration`
owns the protocol: offer under a lease, pull, confirm, free): the source registers its
caches once and hands a `BlockHandle` (agent metadata, region, block ids, lease id) to
the target (step 1); the target READs the source's blocks into its own (steps 2-3), then
sends the lease id back as a notification (step 4).

The bytes move over a `base.Backend` chosen by `transport.open_backend` (NIXL, or the
explicit TCP fallback); the `transport` label on every transfer metric names it, and a
handle from one transport is refused by an engine on another.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from triptych.worker.transfer.base import (
    LEASE_NOTIF_PREFIX,
    TRANSFER_BYTES,
    TRANSFER_FAILURES,
    TRANSFER_SECONDS,
    BlockHandle,
    IncompatibleHandleError,
    LeaseExpiredError,
    PeerUnreachableError,
    Region,
    TransferError,
    TransferTimeoutError,
    check_compatible,
    segments,
)
from triptych.worker.transfer.transport import Require, open_backend

logger = logging.getLogger(__name__)

# A READ needs at least this long before the lease's deadline, or it is not started.
MIN_PULL_S = 0.05


@dataclass
class _Pull:
    """One pull under way: the checked handle, where its blocks go and its deadline."""

    handle: BlockHandle
    local: Region
    local_block_ids: list[int]
    metadata: bytes  # the peer's, decoded
    timeout_s: float
    phases: dict[str, float]
    labels: dict[str, str]
    started: float = 0.0
    deadline: float = 0.0

    def read_args(self) -> tuple[Any, ...]:
        """The backend's `read` / `read_async` arguments, lease included."""
        h = self.handle
        return (h.agent_name, self.metadata, segments(h, self.local, self.local_block_ids), h.mem_type, h.device_id,
                self.local.mem_type, self.local.device_id, self.deadline, (h.lease_id, h.lease_secret))


class TransferEngine:
    """Registers an instance's cache tensors and moves their blocks to/from peers."""

    def __init__(self, name: str, *, require: Require = "any", nixl_plugin: str = "UCX",
                 tcp_host: str | None = None) -> None:
        # A unique agent name per process: peers cache metadata by name, and a restarted
        # instance must not be mistaken for its predecessor.
        self.agent_name = f"{name}-{uuid.uuid4().hex[:8]}"
        self._backend = open_backend(self.agent_name, require, nixl_plugin, tcp_host)
        self.transport: str = self._backend.transport
        self._regions: dict[str, Region] = {}
        self._metadata_b64: str | None = None
        self._peers: dict[str, tuple[str, bytes]] = {}  # agent name -> (base64, decoded) metadata
        log = logger.info if self.transport.startswith("nixl-") else logger.warning
        log("transfer engine %s uses transport %s", self.agent_name, self.transport)

    # -- source side -------------------------------------------------------------

    def register(self, region: str, tensor: torch.Tensor) -> None:
        """Register one cache tensor (once, at start-up); blocks are `tensor[i]`."""
        if region in self._regions:
            raise ValueError(f"region {region!r} is already registered")
        reg = Region.of(region, tensor)
        self._backend.register(reg)
        self._regions[region] = reg
        self._metadata_b64 = None  # metadata now describes more memory

    def deregister(self, region: str) -> None:
        """Stop serving `region` (its cache was dropped with no lease left on it) and let go
        of its tensor; the agent and its other regions stay. Peers reload the metadata,
        which no longer describes that memory, with the next handle they get."""
        self._backend.deregister(self._region(region))
        del self._regions[region]
        self._metadata_b64 = None

    def metadata(self) -> bytes:
        return self._backend.metadata()

    def handle(self, region: str, block_ids: list[int], lease_id: str, *, secret: str, ttl_s: float,
               margin_s: float = 0.0) -> BlockHandle:
        """What the source hands to a target for `block_ids` of `region` under `lease_id`:
        the backend serves reads of exactly those blocks, with `secret`, for `ttl_s`
        (until `revoke`); the handle tells the target to be done `margin_s` before that
        (clock skew between hosts, the source's release latency)."""
        reg = self._region(region)
        bad = [b for b in block_ids if not 0 <= b < reg.num_blocks]
        if bad:
            raise ValueError(f"region {region!r}: block ids out of range [0, {reg.num_blocks}): {bad}")
        if not 0 <= margin_s < ttl_s:
            raise ValueError(f"need 0 <= margin_s < ttl_s, got {margin_s}, {ttl_s}")
        ranges = [(reg.addr(b), reg.block_nbytes) for b in block_ids]
        self._backend.grant(lease_id, secret, ranges, time.monotonic() + ttl_s)
        if self._metadata_b64 is None:
            self._metadata_b64 = base64.b64encode(self.metadata()).decode()
        return BlockHandle(
            transport=self.transport, agent_name=self.agent_name, agent_metadata=self._metadata_b64,
            region=region, mem_type=reg.mem_type, device_id=reg.device_id, base_addr=reg.base_addr,
            block_nbytes=reg.block_nbytes, num_blocks=reg.num_blocks, block_ids=list(block_ids),
            lease_id=lease_id, lease_secret=secret, expires_at=time.time() + ttl_s - margin_s,
            dtype=reg.dtype, block_shape=reg.block_shape,
        )

    def revoke(self, lease_id: str) -> None:
        """The lease is over (confirmed, expired, cancelled): no more reads under it."""
        self._backend.revoke(lease_id)

    def poll_notifications(self) -> list[tuple[str, str]]:
        """(lease id, secret) pairs that targets confirmed since the last call (non-blocking)."""
        leases = []
        for msg in self._backend.notifications():
            if msg.startswith(LEASE_NOTIF_PREFIX):
                lease_id, _, secret = msg[len(LEASE_NOTIF_PREFIX):].decode(errors="replace").partition(":")
                leases.append((lease_id, secret))
            else:
                logger.debug("ignoring notification %r", msg[:64])
        return leases

    # -- target side -------------------------------------------------------------

    def pull(self, handle: BlockHandle | dict[str, Any], local_region: str, local_block_ids: list[int], *,
             timeout_s: float, notify: bool = True, phases: dict[str, float] | None = None) -> int:
        """READ the handle's blocks into `local_block_ids` of `local_region` (any order, need
        not be contiguous), then confirm the lease to the source. Returns bytes moved.

        Raises `IncompatibleHandleError` before moving anything if the layouts differ,
        `PeerUnreachableError` for bad metadata or a dead peer, `TransferTimeoutError`
        after `timeout_s` (the READ is cancelled), `TransferError` otherwise. `phases`, if
        given, gets the seconds of each part: `prepare` (handle checks, metadata),
        `read` (the READ, a first connection to the peer included), `confirm`. Keep
        `timeout_s` below the source's lease TTL; the READ's deadline is also the handle's
        `expires_at`, and a handle with less than MIN_PULL_S left is refused
        (`LeaseExpiredError`) before anything is read: the source may free and reuse the
        blocks after it."""
        pull = self._prepare(handle, local_region, local_block_ids, timeout_s, phases)
        if pull.handle.block_ids:
            with self._reading(pull):
                self._backend.read(*pull.read_args())
        return self._finish(pull, notify)

    async def pull_async(self, handle: BlockHandle | dict[str, Any], local_region: str, local_block_ids: list[int],
                         *, timeout_s: float, notify: bool = True, phases: dict[str, float] | None = None) -> int:
        """`pull` for a caller on an event loop. A backend that can wait for its READ there
        (NIXL: the READ is posted, then its state is polled between the loop's other tasks)
        needs no worker thread: on a busy machine a thread's hand-off and the loop's wake-up
        afterwards cost milliseconds each, far more than a few blocks' READ. Otherwise the
        whole `pull` runs in a worker thread. `phases` also gets `dispatch` (the wait for
        that thread) and `resume` (from its end until the loop went on): 0 without one."""
        phases = {} if phases is None else phases
        read_async = getattr(self._backend, "read_async", None)
        if read_async is None:
            return await self._pull_in_thread(handle, local_region, local_block_ids, timeout_s, notify, phases)
        phases["dispatch"] = 0.0
        pull = self._prepare(handle, local_region, local_block_ids, timeout_s, phases)
        if pull.handle.block_ids:
            with self._reading(pull):
                await read_async(*pull.read_args())
        nbytes = self._finish(pull, notify)
        phases["resume"] = 0.0
        return nbytes

    async def _pull_in_thread(self, handle: BlockHandle | dict[str, Any], local_region: str,
                              local_block_ids: list[int], timeout_s: float, notify: bool,
                              phases: dict[str, float]) -> int:
        dispatched = time.monotonic()
        done = [0.0]

        def pull() -> int:
            phases["dispatch"] = time.monotonic() - dispatched
            nbytes = self.pull(handle, local_region, local_block_ids, timeout_s=timeout_s, notify=notify,
                               phases=phases)
            done[0] = time.monotonic()
            return nbytes

        nbytes = await asyncio.to_thread(pull)
        phases["resume"] = time.monotonic() - done[0]
        return nbytes

    def _prepare(self, handle: BlockHandle | dict[str, Any], local_region: str, local_block_ids: list[int],
                 timeout_s: float, phases: dict[str, float] | None) -> _Pull:
        """Check the handle against the local region and decode the peer's metadata."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        phases = {} if phases is None else phases
        t0 = time.monotonic()
        if isinstance(handle, dict):
            handle = BlockHandle.model_validate(handle)
        local = self._region(local_region)
        check_compatible(handle, local, local_block_ids, self.transport)
        if handle.agent_name == self.agent_name:
            raise IncompatibleHandleError(f"handle {handle.lease_id!r} is from this engine; nothing to transfer")
        pull = _Pull(handle, local, local_block_ids, self._peer_metadata(handle), timeout_s, phases,
                     {"transport": self.transport, "direction": "pull", "region": local_region})
        pull.started = time.monotonic()
        phases["prepare"] = pull.started - t0
        return pull

    @contextmanager
    def _reading(self, pull: _Pull) -> Iterator[None]:
        """Around the backend's READ: the lease must leave it time; failures and successes
        are counted."""
        left = pull.handle.expires_at - time.time()
        if left < MIN_PULL_S:
            TRANSFER_FAILURES.labels(**pull.labels, reason="expired").inc()
            raise LeaseExpiredError(f"lease {pull.handle.lease_id!r} of {pull.handle.agent_name!r} ends in "
                                    f"{left:.3f}s; too late to read its blocks")
        pull.deadline = pull.started + min(pull.timeout_s, left)
        try:
            yield
        except TransferError as e:
            reason = "timeout" if isinstance(e, TransferTimeoutError) else "error"
            TRANSFER_FAILURES.labels(**pull.labels, reason=reason).inc()
            raise
        TRANSFER_SECONDS.labels(**pull.labels).observe(time.monotonic() - pull.started)
        TRANSFER_BYTES.labels(**pull.labels).inc(pull.handle.nbytes)

    def _finish(self, pull: _Pull, notify: bool) -> int:
        read_done = time.monotonic()
        pull.phases["read"] = read_done - pull.started
        if notify:
            self._confirm(pull.handle, pull.metadata)
        pull.phases["confirm"] = time.monotonic() - read_done
        return pull.handle.nbytes

    def _confirm(self, handle: BlockHandle, metadata: bytes) -> None:
        try:
            self._backend.notify(handle.agent_name, metadata, LEASE_NOTIF_PREFIX + f"{handle.lease_id}:{handle.lease_secret}".encode())
        except TransferError as e:
            # The data is here; a source that cannot hear us frees on its lease TTL instead.
            logger.warning("lease %s: could not notify %s: %s", handle.lease_id, handle.agent_name, e)

    def _peer_metadata(self, handle: BlockHandle) -> bytes:
        """The peer's metadata, decoded once per peer: every handle of one source carries
        the same text, so later ones cost a string comparison, not a base64 decode."""
        known = self._peers.get(handle.agent_name)
        if known is not None and known[0] == handle.agent_metadata:
            return known[1]
        try:
            metadata = base64.b64decode(handle.agent_metadata, validate=True)
        except ValueError as e:
            raise PeerUnreachableError(f"handle {handle.lease_id!r}: agent_metadata is not base64: {e}") from e
        self._peers[handle.agent_name] = (handle.agent_metadata, metadata)
        return metadata

    def _region(self, region: str) -> Region:
        try:
            return self._regions[region]
        except KeyError:
            raise KeyError(f"unknown region {region!r}; registered: {sorted(self._regions)}") from None

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
