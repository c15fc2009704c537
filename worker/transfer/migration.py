"""Source-side leases for pull-based migration (HydraInfer §4.3).

The source keeps a request's blocks while a target pulls them: `offer` records a lease
(region, block ids, how to free them, a TTL) and its id goes into the `BlockHandle`
(step 1); the target READs (steps 2-3) and sends the lease id back as a notification
(step 4); `confirm` then runs the lease's `on_release` (the source frees the blocks).
A lease nobody confirms (target died, request dropped) is freed by `expire` once its
TTL passes, so blocks never leak; `cancel` frees at once (request aborted).

Every lease is released exactly once whichever of confirm / expire / cancel comes
first; later calls for the same id are no-ops. `on_release` runs outside the table's
lock, on the calling thread (for `run_lease_pump`: the event loop's thread).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from triptych.worker.transfer.base import registry_metric
from triptych.worker.transfer.nixl import TransferEngine

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
    expires_at: float


class LeaseTable:
    """Thread-safe table of outstanding leases; `clock` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def offer(self, region: str, block_ids: list[int], on_release: Callable[[], None], ttl_s: float) -> str:
        """Hold `block_ids` of `region` for a target; returns the lease id for the handle."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        lease = Lease(uuid.uuid4().hex, region, tuple(block_ids), on_release, self._clock() + ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease.lease_id

    def confirm(self, lease_id: str) -> bool:
        """The target has the blocks: free them. False if the lease is already gone."""
        return self._release(lease_id, "confirmed")

    def cancel(self, lease_id: str) -> bool:
        """The request was aborted: free the blocks now; a later confirmation is ignored."""
        return self._release(lease_id, "cancelled")

    def expire(self, now: float | None = None) -> list[str]:
        """Free every lease whose TTL has passed; returns their ids."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        return [lid for lid in due if self._release(lid, "expired")]

    def outstanding(self) -> int:
        with self._lock:
            return len(self._leases)

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
            lease.on_release()
        except Exception:
            # The lease is gone either way; a failing free must not stop the pump.
            logger.exception("lease %s: on_release failed", lease_id)
        return True


def pump_once(engine: TransferEngine, table: LeaseTable) -> int:
    """Confirm the leases targets reported, then expire overdue ones; returns releases."""
    released = sum(table.confirm(lid) for lid in engine.poll_notifications())
    return released + len(table.expire())


async def run_lease_pump(engine: TransferEngine, table: LeaseTable, interval_s: float = 0.005,
                         idle_interval_s: float = 0.1) -> None:
    """Run `pump_once` until cancelled (start with asyncio.create_task): every `interval_s`
    while leases are outstanding, every `idle_interval_s` otherwise.

    Polling is a non-blocking call into the agent, cheap enough for the event loop; a
    short interval keeps the source's blocks held no longer than needed, and the idle
    interval keeps an instance with nothing handed out from burning a core."""
    if interval_s <= 0 or idle_interval_s <= 0:
        raise ValueError(f"intervals must be > 0, got {interval_s}, {idle_interval_s}")
    while True:
        try:
            pump_once(engine, table)
        except Exception:
            logger.exception("lease pump iteration failed")
        await asyncio.sleep(interval_s if table.outstanding() else idle_interval_s)
