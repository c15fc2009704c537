"""Source-side leases of pull-based migration (HydraInfer §4.3), and the pump that
releases them.

The source keeps a request's blocks while a target pulls them: `offer` records a lease
(region, block ids, how to free them, a TTL, a random secret) and its id, secret and
wall-clock expiry go into the `BlockHandle` (step 1); the target READs (steps 2-3) and
sends the lease id and secret back as a notification (step 4); `confirm` then runs the
lease's `on_release` (the source frees the blocks). A confirmation without the lease's
secret releases nothing: only the peer the handle was given to can end a lease early.
A lease nobody confirms (target died, request dropped) is freed by `expire` once its
TTL passes, so blocks never leak; `cancel` frees at once (request aborted).

Every lease is released exactly once whichever of confirm / expire / cancel comes
first; later calls for the same id are no-ops. `on_release` runs outside the table's
lock, on the calling thread (for `run_lease_pump`: the event loop's thread).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter

from triptych.worker.transfer.base import registry_metric

logger = logging.getLogger(__name__)

LEASE_EXPIRED: Counter = registry_metric(
    Counter, "triptych_worker_lease_expired_total",
    "Migration leases freed because no target confirmed them within their TTL", ["region"])
LEASE_RELEASED: Counter = registry_metric(
    Counter, "triptych_worker_lease_released_total",
    "Migration leases released, by how (confirmed, expired, cancelled)", ["region", "how"])


@dataclass(frozen=True)
class Lease:
    lease_id: str
    region: str
    block_ids: tuple[int, ...]
    on_release: Callable[[], None]
    expires_at: float  # on the table's clock (monotonic)
    owner: str = ""  # the request whose blocks these are (for cancel_owner)
    secret: str = ""  # proves a confirmation (and a TCP read) comes from the handle's holder
    ttl_s: float = 0.0


class LeaseTable:
    """Thread-safe table of outstanding leases; `clock` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_any_release: Callable[[Lease], None] | None = None) -> None:
        # on_any_release runs first on every release (the transfer engine revokes the
        # lease's read grant there), then the lease's own on_release.
        self._clock = clock
        self._on_any_release = on_any_release
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._listeners: list[Callable[[], None]] = []

    def offer(self, region: str, block_ids: list[int], on_release: Callable[[], None], ttl_s: float,
              owner: str = "") -> Lease:
        """Hold `block_ids` of `region` for a target; returns the lease (its id and secret
        go into the handle)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        lease = Lease(uuid.uuid4().hex, region, tuple(block_ids), on_release, self._clock() + ttl_s, owner,
                      secrets.token_urlsafe(24), ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = lease
            listeners = list(self._listeners)
        for wake in listeners:
            wake()
        return lease

    def confirm(self, lease_id: str, secret: str) -> bool:
        """The target has the blocks: free them. False if the lease is already gone, or
        `secret` is not the lease's (then the lease stays until its holder or the TTL)."""
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            logger.debug("lease %s already released (confirmation ignored)", lease_id)
            return False
        if not hmac.compare_digest(secret.encode(), lease.secret.encode()):
            logger.warning("lease %s: confirmation with a wrong secret ignored", lease_id)
            return False
        return self._release(lease_id, "confirmed")

    def cancel(self, lease_id: str) -> bool:
        """The request was aborted: free the blocks now; a later confirmation is ignored."""
        return self._release(lease_id, "cancelled")

    def cancel_owner(self, owner: str) -> int:
        """Cancel every lease of one request; returns how many were still outstanding."""
        with self._lock:
            ids = [lid for lid, lease in self._leases.items() if lease.owner == owner]
        return sum(self.cancel(lid) for lid in ids)

    def expire(self, now: float | None = None) -> list[str]:
        """Free every lease whose TTL has passed; returns their ids."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        return [lid for lid in due if self._release(lid, "expired")]

    def outstanding(self) -> int:
        with self._lock:
            return len(self._leases)

    def subscribe(self, on_offer: Callable[[], None]) -> Callable[[], None]:
        """Call `on_offer` after every offer (on the offering thread); returns the unsubscriber."""
        with self._lock:
            self._listeners.append(on_offer)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners.remove(on_offer)
        return unsubscribe

    def _release(self, lease_id: str, how: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            logger.debug("lease %s already released (%s ignored)", lease_id, how)
            return False
        if how == "expired":
            LEASE_EXPIRED.labels(region=lease.region).inc()
            logger.warning("lease %s (%s, %d blocks) expired unconfirmed; freeing",
                           lease_id, lease.region, len(lease.block_ids))
        LEASE_RELEASED.labels(region=lease.region, how=how).inc()
        try:
            if self._on_any_release is not None:
                self._on_any_release(lease)
            lease.on_release()
        except Exception:
            # The lease is gone either way; a failing free must not stop the pump.
            logger.exception("lease %s: on_release failed", lease_id)
        return True


class Notifications(Protocol):
    """Where lease confirmations arrive (`TransferEngine` satisfies it)."""

    def poll_notifications(self) -> list[tuple[str, str]]: ...


def pump_once(transfer: Notifications, table: LeaseTable) -> int:
    """Confirm the leases targets reported, then expire overdue ones; returns releases."""
    released = sum(table.confirm(lid, secret) for lid, secret in transfer.poll_notifications())
    return released + len(table.expire())


async def run_lease_pump(transfer: Notifications, table: LeaseTable, interval_s: float = 0.005,
                         max_interval_s: float = 0.02) -> None:
    """Release leases until cancelled (start with asyncio.create_task).

    While no lease is outstanding the pump sleeps on an event that `offer` sets: an idle
    instance does no work at all. Late confirmations of leases already gone wait in the
    transport's queue and are drained (and ignored) on the next poll. While leases are
    outstanding, confirmations must be polled (the transports have no wake-up); the
    interval starts at `interval_s` after each offer or release, so a hand-off's blocks
    are held no longer than needed, and doubles up to `max_interval_s` while nothing
    happens, which bounds the cost of a lease waiting on a slow target or its TTL."""
    if not 0 < interval_s <= max_interval_s:
        raise ValueError(f"need 0 < interval_s <= max_interval_s, got {interval_s}, {max_interval_s}")
    loop = asyncio.get_running_loop()
    offered = asyncio.Event()

    def wake() -> None:  # any thread may offer
        try:
            loop.call_soon_threadsafe(offered.set)
        except RuntimeError:  # the loop is closed: the pump is gone with it
            pass

    unsubscribe = table.subscribe(wake)
    delay = interval_s
    try:
        while True:
            if not table.outstanding():
                offered.clear()
                if not table.outstanding():  # an offer between the check and clear() set it again
                    await offered.wait()
                delay = interval_s
            try:
                released = pump_once(transfer, table)
            except Exception:
                logger.exception("lease pump iteration failed")
                released = 0
            if released or offered.is_set():
                offered.clear()
                delay = interval_s
            else:
                delay = min(delay * 2, max_interval_s)
            await asyncio.sleep(delay)
    finally:
        unsubscribe()
