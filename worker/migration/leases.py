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
import contextlib
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Collection
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

    def outstanding(self, owner_suffix: str | None = None, owners: Collection[str] | None = None) -> int:
        """Leases not yet released; with `owner_suffix`, those whose owner ends with it; with
        `owners`, those whose owner is one of them."""
        with self._lock:
            return sum(1 for lease in self._leases.values()
                       if (owner_suffix is None or lease.owner.endswith(owner_suffix))
                       and (owners is None or lease.owner in owners))

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
    return settle(table, transfer.poll_notifications())


def settle(table: LeaseTable, notes: list[tuple[str, str]]) -> int:
    """Confirm the leases of `notes` (lease id, secret), then expire overdue ones; returns releases."""
    released = sum(table.confirm(lid, secret) for lid, secret in notes)
    return released + len(table.expire())


async def run_lease_pump(transfer: Notifications, table: LeaseTable, interval_s: float = 2.5e-4,
                         max_interval_s: float = 0.01, fast_s: float = 0.25, expiry_check_s: float = 0.05) -> None:
    """Release leases until cancelled (start with asyncio.create_task).

    A NIXL READ over UCX's tcp/cma transports completes only while the *source* makes
    progress, and this agent runs no progress thread (it spins: a fifth of a core per idle
    instance). So while a lease is outstanding a progress thread polls the transport —
    every `interval_s` for `fast_s` after each offer or confirmation (a target reads then;
    each poll costs microseconds), backing off to `max_interval_s` for a lease left waiting
    on a slow target or its TTL — and hands each confirmation to the event loop at once:
    leases are released on the event that confirms them, not on the next tick of a timer.
    While no lease is outstanding neither the thread nor the loop does any work (late
    confirmations of leases already gone wait in the transport's queue and are drained,
    and ignored, on the next poll). Expiry is checked every `expiry_check_s` while leases
    are outstanding (TTLs are seconds). Releases run on the event loop's thread."""
    if not 0 < interval_s <= max_interval_s:
        raise ValueError(f"need 0 < interval_s <= max_interval_s, got {interval_s}, {max_interval_s}")
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()  # confirmations arrived, or an offer was made
    offered = threading.Event()  # wakes the progress thread
    stop = threading.Event()
    inbox: list[tuple[str, str]] = []
    inbox_lock = threading.Lock()

    def wake_loop() -> None:
        try:
            loop.call_soon_threadsafe(woken.set)
        except RuntimeError:  # the loop is closed: the pump is gone with it
            pass

    def on_offer() -> None:  # any thread may offer
        offered.set()
        wake_loop()

    def drive() -> None:
        last_activity, delay = time.monotonic(), interval_s
        while not stop.is_set():
            if not table.outstanding():
                offered.wait()
                offered.clear()
                last_activity, delay = time.monotonic(), interval_s
                continue
            try:
                notes = transfer.poll_notifications()
            except Exception:
                logger.exception("lease pump: polling notifications failed")
                notes = []
            now = time.monotonic()
            if notes:
                with inbox_lock:
                    inbox.extend(notes)
                wake_loop()
                last_activity = now
            if offered.is_set():
                offered.clear()
                last_activity = now
            delay = interval_s if now - last_activity < fast_s else min(delay * 2, max_interval_s)
            offered.wait(delay)

    unsubscribe = table.subscribe(on_offer)
    thread = threading.Thread(target=drive, name="lease-pump", daemon=True)
    thread.start()
    try:
        while True:
            if table.outstanding():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), expiry_check_s)
            else:
                await woken.wait()
            woken.clear()
            with inbox_lock:
                notes, inbox[:] = list(inbox), []
            try:
                settle(table, notes)
            except Exception:
                logger.exception("lease pump iteration failed")
    finally:
        unsubscribe()
        stop.set()
        offered.set()
        thread.join(timeout=1.0)
