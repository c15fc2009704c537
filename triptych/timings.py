"""Exact recent timings of one process: a bounded ring of records (a migration's phases on a
worker, a request's own overhead on the router), read by `bench serve` from an admin
endpoint (`GET /admin/timings?since=N`) so that it reports exact percentiles rather than
histogram-bucket interpolations. Torch-free: the router and the bench import it.

Each record gets a sequence number; a reader keeps the `next` it was given and asks for
what came after it. `dropped` says records it never saw fell off the ring (a reader that
polls less often than `capacity` records arrive).
"""

from __future__ import annotations

import threading
from collections import deque

from pydantic import BaseModel, Field

DEFAULT_CAPACITY = 4096  # records kept; at ~200 B each, under 1 MB per process


class TimingRecord(BaseModel):
    seq: int
    kind: str  # "ep" / "pd" (a migration pulled here), "request" (the router's own overhead)
    seconds: float  # the whole of it
    phases: dict[str, float] = Field(default_factory=dict)  # name -> seconds, parts of `seconds`
    nbytes: int = 0  # bytes moved (migrations)


class TimingsPage(BaseModel):
    """The answer of `GET /admin/timings?since=N`."""

    next: int  # pass as `since` next time
    dropped: bool  # records after `since` fell off the ring before this read
    records: list[TimingRecord]


class TimingRing:
    """Thread-safe: migrations record from transfer threads, the endpoint reads on the loop."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._records: deque[TimingRecord] = deque(maxlen=capacity)
        self._next = 0
        self._lock = threading.Lock()

    def record(self, kind: str, seconds: float, phases: dict[str, float] | None = None, nbytes: int = 0) -> None:
        with self._lock:
            self._records.append(TimingRecord(seq=self._next, kind=kind, seconds=seconds,
                                              phases=dict(phases or {}), nbytes=nbytes))
            self._next += 1

    def page(self, since: int = 0) -> TimingsPage:
        """Every record with seq >= `since` still held."""
        with self._lock:
            records = [r for r in self._records if r.seq >= since]
            oldest = self._records[0].seq if self._records else self._next
            return TimingsPage(next=self._next, dropped=since < oldest, records=records)

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next


# One ring per process: a worker's migrations, or a router's requests.
TIMINGS = TimingRing()
