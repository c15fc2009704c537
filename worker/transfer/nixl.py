"""The NIXL (UCX) transport backend: one-sided READs of registered cache blocks.

NIXL with the UCX plugin works on DRAM too (tcp/loopback + cma), so it is the default
transport everywhere; `transport.open_backend` picks it, or the explicit TCP fallback.
This module is only the backend (`base.Backend`): `engine.TransferEngine` does the block
arithmetic, handles and metrics around it.

Thread-safety: every call into the NIXL agent holds one lock, released while a READ
waits, so reads may run in several worker threads at once (e.g. `asyncio.to_thread`), or
on the event loop (`read_async`), while the event loop polls notifications; region
registration is meant for start-up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from triptych.worker.transfer.base import (
    IncompatibleHandleError,
    MemType,
    PeerUnreachableError,
    Region,
    Segment,
    TransferError,
    TransferTimeoutError,
    TransportUnavailableError,
)

logger = logging.getLogger(__name__)

_SPIN_S = 5e-4  # busy-poll window before a waiting pull starts to sleep


def _pauses() -> Iterator[float]:
    """Seconds to pause before each check of a READ's state: none for `_SPIN_S` (a few blocks
    arrive in microseconds, and a sleeping thread on a busy machine wakes only milliseconds
    later), then 50 us doubling up to 1 ms."""
    spin_until = time.monotonic() + _SPIN_S
    delay = 0.0
    while True:
        if time.monotonic() > spin_until:
            delay = min(delay * 2 or 5e-5, 1e-3)
        yield delay


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
            # No progress thread: it spins (~0.2 of a core per idle instance). Our pulls and
            # notification reads drive progress themselves while a transfer is under way.
            agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=[plugin]))
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
        self._registrations: dict[str, Any] = {}  # region name -> its NIXL registration
        self._leaked: list[Any] = []  # xfer handles NIXL could not cancel yet

    def register(self, region: Region) -> None:
        desc = (region.base_addr, region.nbytes, region.device_id, "")
        with self._lock:
            self._registrations[region.name] = self._agent.register_memory([desc], region.mem_type, [self._plugin])

    def deregister(self, region: Region) -> None:
        with self._lock:
            self._agent.deregister_memory(self._registrations.pop(region.name), [self._plugin])

    def metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    # NIXL (UCX rkeys) cannot scope a peer's READs below a registered region: whoever holds
    # this agent's metadata can read the whole cache tensor. Leases are enforced by the
    # protocol (secrets, expiry), not here; the metadata stays inside the deployment.
    def grant(self, lease_id: str, secret: str, ranges: list[tuple[int, int]], deadline: float) -> None:
        pass

    def revoke(self, lease_id: str) -> None:
        pass

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
             remote_device: int, local_mem: MemType, local_device: int, deadline: float,
             lease: tuple[str, str] = ("", "")) -> None:
        with self._posted(peer, peer_metadata, segs, remote_mem, remote_device, local_mem, local_device) as (xfer,
                                                                                                          state):
            pauses = _pauses()
            while self._waiting(state, peer, deadline):
                pause = next(pauses)
                if pause:
                    time.sleep(pause)
                state = self._state(xfer)

    async def read_async(self, peer: str, peer_metadata: bytes, segs: list[Segment], remote_mem: MemType,
                         remote_device: int, local_mem: MemType, local_device: int, deadline: float,
                         lease: tuple[str, str] = ("", "")) -> None:
        """`read` on an event loop: the READ is posted, then its state is checked each time
        the loop comes round (other tasks run between), with `read`'s pauses. No thread is
        involved."""
        with self._posted(peer, peer_metadata, segs, remote_mem, remote_device, local_mem, local_device) as (xfer,
                                                                                                          state):
            pauses = _pauses()
            while self._waiting(state, peer, deadline):
                await asyncio.sleep(next(pauses))
                state = self._state(xfer)

    @contextmanager
    def _posted(self, peer: str, peer_metadata: bytes, segs: list[Segment], remote_mem: MemType,
                remote_device: int, local_mem: MemType, local_device: int) -> Iterator[tuple[Any, str]]:
        """Post a READ; the body waits for it (`(xfer handle, first state)`). Its handle is
        released afterwards, whatever happened; a failure other than a timeout drops the
        peer (a disconnected peer must be loaded afresh if it comes back)."""
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
            yield xfer, state
        except TransferTimeoutError:
            raise  # a slow peer is not a gone peer: keep its connection
        except Exception as e:
            if xfer is not None:
                self._release(xfer)
                xfer = None
            self._forget(peer)
            if isinstance(e, TransferError):
                raise
            cls = PeerUnreachableError if "DISCONNECT" in str(e) else TransferError
            raise cls(f"NIXL READ from {peer!r} failed: {_describe(e)}") from e
        finally:
            if xfer is not None:
                self._release(xfer)

    def _state(self, xfer: Any) -> str:
        with self._lock:
            return self._agent.check_xfer_state(xfer)

    @staticmethod
    def _waiting(state: str, peer: str, deadline: float) -> bool:
        """True while the READ runs; raises once it failed or its deadline passed."""
        if state == "DONE":
            return False
        if state != "PROC":
            raise TransferError(f"NIXL READ from {peer!r} failed (state {state})")
        if time.monotonic() > deadline:
            raise TransferTimeoutError(f"NIXL READ from {peer!r} did not complete in time; cancelled")
        return True

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
            for reg in self._registrations.values():
                self._agent.deregister_memory(reg, [self._plugin])
            self._registrations.clear()
