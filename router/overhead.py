"""The router's own overhead per request: the time it spends on a request that is not spent
waiting on a worker (planning, building stage requests, parsing events, relaying the
hand-over handles), measured up to the request's first token — the part of TTFT the
router adds. Recorded exactly in the process's timing ring (triptych/timings.py, kind
"request") for `bench serve`, and as a histogram.

Waits may overlap (parallel encode-only runs): the clock counts the union of waiting
intervals, so overlapping waits count once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from triptych.timings import TIMINGS, TimingRing


class WaitClock:
    """Wall time of one request, and how much of it some worker call was being awaited."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.waited = 0.0
        self._open = 0  # waits in progress
        self._since = 0.0  # when the current union of waits began

    def begin(self) -> None:
        if self._open == 0:
            self._since = self._clock()
        self._open += 1

    def end(self) -> None:
        if self._open <= 0:
            raise RuntimeError("WaitClock.end() without begin()")
        self._open -= 1
        if self._open == 0:
            self.waited += self._clock() - self._since

    def overhead(self) -> tuple[float, float]:
        """(elapsed, elapsed minus waited) so far; a wait in progress counts as waited."""
        now = self._clock()
        waited = self.waited + (now - self._since if self._open else 0.0)
        elapsed = now - self.started
        return elapsed, max(0.0, elapsed - waited)


def record_first_token(clock: WaitClock, timings: TimingRing = TIMINGS) -> float:
    """At a request's first token: record its overhead so far; returns it (seconds)."""
    elapsed, own = clock.overhead()
    timings.record("request", own, {"waited": elapsed - own, "elapsed": elapsed})
    return own
