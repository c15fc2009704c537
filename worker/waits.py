"""Bounded waits on the worker's event loop for a condition no event signals (an engine
queue emptying, leases confirmed from transfer threads): poll it, give up at a deadline.
Every wait in a switch or a drain has a timeout; this is the one loop they share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_for(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.001) -> bool:
    """Poll until `cond()` holds or `timeout_s` passed; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
