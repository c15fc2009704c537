"""The worker's transfer engine: NIXL (UCX) READs of cache blocks between instances.

Pull-based migration, HydraInfer §4.3: the source registers its caches once and hands a
`BlockHandle` (agent metadata, region, block ids, lease id) to the target (step 1); the
target allocates local blocks and READs the source's blocks (steps 2-3), then sends the
lease id back as a NIXL notification (step 4) so the source frees them (see
`migration.LeaseTable`).

Transport choice (never silent): NIXL with the UCX plugin by default (works on DRAM too:
tcp/loopback + cma). If NIXL cannot start, `require="nixl"` raises
`TransportUnavailableError` carrying the underlying error; `require="any"` falls back to
the explicit TCP transport (`tcp.TcpBackend`, label "tcp", CPU tensors only) with a
startup warning. The `transport` label on every transfer metric names the one in use,
and a handle from one transport is refused by an engine on another.

Thread-safety: every call into the NIXL agent holds one lock, released while a pull
waits, so `pull` may run in several worker threads at once (e.g. `asyncio.to_thread`)
while the event loop calls `poll_notifications`; region registration is meant for
start-up (before any handle is served).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from typing import Any, Literal

import numpy as np
import torch

from triptych.worker.transfer.base import (
    LEASE_NOTIF_PREFIX,
    TRANSFER_BYTES,
    TRANSFER_FAILURES,
    TRANSFER_SECONDS,
    Backend,
    BlockHandle,
    IncompatibleHandleError,
    MemType,
    PeerUnreachableError,
    Region,
    Segment,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
    check_compatible,
    segments,
)

logger = logging.getLogger(__name__)

_SPIN_S = 5e-4  # busy-poll window before a waiting pull starts to sleep


def _describe(exc: BaseException) -> str:
    # NIXL's binding errors carry only the status name (e.g. NIXL_ERR_REMOTE_DISCONNECT).
    return f"{type(exc).__name__}: {exc}"


class NixlBackend:
    """One `nixl_agent` with one backend plugin (UCX by default)."""

    def __init__(self, agent_name: str, plugin: str = "UCX") -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # ImportError, or OSError from the bundled shared libraries
            raise TransportUnavailableError(f"NIXL cannot be imported: {_describe(e)}") from e
        try:
            agent = nixl_agent(agent_name, nixl_agent_config(backends=[plugin]))
        except Exception as e:
            raise TransportUnavailableError(f"NIXL agent {agent_name!r} could not start: {_describe(e)}") from e
        if plugin not in agent.backends:
            raise TransportUnavailableError(
                f"NIXL backend plugin {plugin!r} did not start (plugins found: {agent.plugin_list})"
            )
        self.transport = f"nixl-{plugin.lower()}"
        self._agent = agent
        self._plugin = plugin
        self._lock = threading.Lock()
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata it was loaded from
        self._registrations: list[Any] = []
        self._leaked: list[Any] = []  # xfer handles NIXL could not cancel yet

    def register(self, region: Region) -> None:
        desc = (region.base_addr, region.nbytes, region.device_id, "")
        with self._lock:
            self._registrations.append(self._agent.register_memory([desc], region.mem_type, [self._plugin]))

    def metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def _connect(self, peer: str, peer_metadata: bytes) -> None:
        """Load a peer's metadata once per agent name; reload when it changed (the peer
        registered more memory, or restarted under the same name)."""
        with self._lock:
            known = self._remotes.get(peer)
            if known == peer_metadata:
                return
            if known is not None:
                del self._remotes[peer]
                self._remove_quietly(peer)
            try:
                loaded = self._agent.add_remote_agent(peer_metadata)
            except Exception as e:
                raise PeerUnreachableError(f"cannot load metadata of NIXL agent {peer!r}: {_describe(e)}") from e
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer:
                if name not in self._remotes:
                    self._remove_quietly(name)
                raise IncompatibleHandleError(f"metadata is for agent {name!r}, handle names {peer!r}")
            self._remotes[peer] = peer_metadata

    def _remove_quietly(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:  # already disconnected: nothing left to remove
            logger.debug("removing NIXL agent %s: %s", peer, _describe(e))

    def _forget(self, peer: str) -> None:
        with self._lock:
            if self._remotes.pop(peer, None) is not None:
                self._remove_quietly(peer)

    def read(self, peer: str, peer_metadata: bytes, segs: list[Segment], remote_mem: MemType,
             remote_device: int, local_mem: MemType, local_device: int, deadline: float) -> None:
        self._connect(peer, peer_metadata)
        local = np.array([(s.local_addr, s.nbytes, local_device) for s in segs], dtype=np.uint64)
        remote = np.array([(s.remote_addr, s.nbytes, remote_device) for s in segs], dtype=np.uint64)
        xfer = None
        try:
            with self._lock:
                self._retry_leaked()
                xfer = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, local_mem),
                    self._agent.get_xfer_descs(remote, remote_mem),
                    peer,
                    backends=[self._plugin],
                )
                state = self._agent.transfer(xfer)
            self._wait(xfer, state, peer, deadline)
        except TransferTimeoutError:
            raise  # a slow peer is not a gone peer: keep its connection
        except Exception as e:
            if xfer is not None:
                self._release(xfer)
                xfer = None
            self._forget(peer)  # a disconnected peer must be loaded afresh if it comes back
            if isinstance(e, TransferError):
                raise
            cls = PeerUnreachableError if "DISCONNECT" in str(e) else TransferError
            raise cls(f"NIXL READ from {peer!r} failed: {_describe(e)}") from e
        finally:
            if xfer is not None:
                self._release(xfer)

    def _wait(self, xfer: Any, state: str, peer: str, deadline: float) -> None:
        # Spin first: a few blocks arrive in microseconds, and a sleeping thread on a busy
        # machine wakes only milliseconds later. Then back off to 1 ms sleeps.
        spin_until = time.monotonic() + _SPIN_S
        delay = 0.0
        while state == "PROC":
            now = time.monotonic()
            if now > deadline:
                raise TransferTimeoutError(f"NIXL READ from {peer!r} did not complete in time; cancelled")
            if now > spin_until:
                time.sleep(delay)
                delay = min(delay * 2 or 5e-5, 1e-3)
            with self._lock:
                state = self._agent.check_xfer_state(xfer)
        if state != "DONE":
            raise TransferError(f"NIXL READ from {peer!r} failed (state {state})")

    def _release(self, xfer: Any) -> None:
        with self._lock:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception as e:
                # NIXL could not cancel an in-flight READ: keep the handle and retry later.
                logger.error("NIXL could not release a transfer handle (%s); retrying later", _describe(e))
                self._leaked.append(xfer)

    def _retry_leaked(self) -> None:
        still = []
        for xfer in self._leaked:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception:
                still.append(xfer)
        self._leaked = still

    def notify(self, peer: str, peer_metadata: bytes, message: bytes) -> None:
        self._connect(peer, peer_metadata)
        with self._lock:
            try:
                # No backend argument: nixl 1.5.1's send_notif passes it to the binding as an
                # int where a list is expected (TypeError); we run one backend anyway.
                self._agent.send_notif(peer, message)
            except Exception as e:
                raise TransferError(f"NIXL notification to {peer!r} failed: {_describe(e)}") from e

    def notifications(self) -> list[bytes]:
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        with self._lock:
            self._retry_leaked()
            for peer in list(self._remotes):
                self._remove_quietly(peer)
            self._remotes.clear()
            for reg in self._registrations:
                self._agent.deregister_memory(reg, [self._plugin])
            self._registrations.clear()


def open_backend(agent_name: str, require: Literal["nixl", "any"], nixl_plugin: str,
                 tcp_host: str | None) -> Backend:
    """NIXL, else (require="any" only) the explicit TCP fallback, announced with a warning."""
    if require not in ("nixl", "any"):
        raise ValueError(f"require must be 'nixl' or 'any', got {require!r}")
    try:
        return NixlBackend(agent_name, nixl_plugin)
    except TransportUnavailableError as e:
        if require == "nixl":
            raise
        from triptych.worker.transfer.tcp import TcpBackend

        logger.warning("NIXL unavailable (%s); falling back to the TCP transport (slower, CPU memory only)", e)
        return TcpBackend(agent_name, host=tcp_host)


class TransferEngine:
    """Registers an instance's cache tensors and moves their blocks to/from peers."""

    def __init__(self, name: str, *, require: Literal["nixl", "any"] = "any", nixl_plugin: str = "UCX",
                 tcp_host: str | None = None) -> None:
        # A unique agent name per process: peers cache metadata by name, and a restarted
        # instance must not be mistaken for its predecessor.
        self.agent_name = f"{name}-{uuid.uuid4().hex[:8]}"
        self._backend = open_backend(self.agent_name, require, nixl_plugin, tcp_host)
        self.transport: str = self._backend.transport
        self._regions: dict[str, Region] = {}
        self._metadata_b64: str | None = None
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

    def metadata(self) -> bytes:
        return self._backend.metadata()

    def handle(self, region: str, block_ids: list[int], lease_id: str) -> BlockHandle:
        """What the source hands to a target for `block_ids` of `region` under `lease_id`."""
        reg = self._region(region)
        bad = [b for b in block_ids if not 0 <= b < reg.num_blocks]
        if bad:
            raise ValueError(f"region {region!r}: block ids out of range [0, {reg.num_blocks}): {bad}")
        if self._metadata_b64 is None:
            self._metadata_b64 = base64.b64encode(self.metadata()).decode()
        return BlockHandle(
            transport=self.transport, agent_name=self.agent_name, agent_metadata=self._metadata_b64,
            region=region, mem_type=reg.mem_type, device_id=reg.device_id, base_addr=reg.base_addr,
            block_nbytes=reg.block_nbytes, num_blocks=reg.num_blocks, block_ids=list(block_ids),
            lease_id=lease_id, dtype=reg.dtype, block_shape=reg.block_shape,
        )

    def poll_notifications(self) -> list[str]:
        """Lease ids that targets confirmed since the last call (non-blocking)."""
        leases = []
        for msg in self._backend.notifications():
            if msg.startswith(LEASE_NOTIF_PREFIX):
                leases.append(msg[len(LEASE_NOTIF_PREFIX):].decode())
            else:
                logger.debug("ignoring notification %r", msg[:64])
        return leases

    # -- target side -------------------------------------------------------------

    def pull(self, handle: BlockHandle | dict[str, Any], local_region: str, local_block_ids: list[int], *,
             timeout_s: float, notify: bool = True) -> int:
        """READ the handle's blocks into `local_block_ids` of `local_region` (any order, need
        not be contiguous), then confirm the lease to the source. Returns bytes moved.

        Raises `IncompatibleHandleError` before moving anything if the layouts differ,
        `PeerUnreachableError` for bad metadata or a dead peer, `TransferTimeoutError`
        after `timeout_s` (the READ is cancelled), `TransferError` otherwise. Keep
        `timeout_s` below the source's lease TTL, or the source may free (and reuse)
        the blocks while they are being read."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(handle, dict):
            handle = BlockHandle.model_validate(handle)
        local = self._region(local_region)
        check_compatible(handle, local, local_block_ids, self.transport)
        if handle.agent_name == self.agent_name:
            raise IncompatibleHandleError(f"handle {handle.lease_id!r} is from this engine; nothing to transfer")
        metadata = self._decode_metadata(handle)
        labels = {"transport": self.transport, "direction": "pull", "region": local_region}
        if handle.block_ids:
            started = time.monotonic()
            try:
                self._backend.read(handle.agent_name, metadata, segments(handle, local, local_block_ids),
                                   handle.mem_type, handle.device_id, local.mem_type, local.device_id,
                                   deadline=started + timeout_s)
            except TransferError as e:
                reason = "timeout" if isinstance(e, TransferTimeoutError) else "error"
                TRANSFER_FAILURES.labels(**labels, reason=reason).inc()
                raise
            TRANSFER_SECONDS.labels(**labels).observe(time.monotonic() - started)
            TRANSFER_BYTES.labels(**labels).inc(handle.nbytes)
        if notify:
            self._confirm(handle, metadata)
        return handle.nbytes

    def _confirm(self, handle: BlockHandle, metadata: bytes) -> None:
        try:
            self._backend.notify(handle.agent_name, metadata, LEASE_NOTIF_PREFIX + handle.lease_id.encode())
        except TransferError as e:
            # The data is here; a source that cannot hear us frees on its lease TTL instead.
            logger.warning("lease %s: could not notify %s: %s", handle.lease_id, handle.agent_name, e)

    @staticmethod
    def _decode_metadata(handle: BlockHandle) -> bytes:
        try:
            return base64.b64decode(handle.agent_metadata, validate=True)
        except ValueError as e:
            raise PeerUnreachableError(f"handle {handle.lease_id!r}: agent_metadata is not base64: {e}") from e

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
