"""Polling for tests that watch another thread or process: every wait has a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    """True as soon as `pred()` holds; False if it still does not at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


async def eventually(pred: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    """`wait_until` for a test running on an event loop: sleeps without blocking it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(interval_s)
    return pred()
