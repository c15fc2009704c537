"""A uvicorn server that drains before it exits, for every kind of worker process.

On SIGTERM/SIGINT (Kubernetes deleting the pod, a scale-down) the instance first stops
taking work (its /health says `draining`, so the router stops routing to it), finishes
what it holds and keeps its hand-overs alive until the next stage has pulled them (bounded
by the instance's drain deadline); only then does uvicorn shut down. A second signal exits
at once. Kept free of torch and the engine: the V instance (worker/video_instance.py)
uses it too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import uvicorn

log = logging.getLogger("triptych.worker.draining")


class Drainable(Protocol):
    def begin_drain(self) -> bool:
        """Stop taking work; False when there is nothing to drain (exit at once)."""
        ...

    async def drain(self) -> None:
        """Return once held work and hand-overs are done (or the drain deadline passed)."""
        ...


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, instance: Drainable) -> None:
        super().__init__(config)
        self.instance = instance
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None or not self.instance.begin_drain():
            return super().handle_exit(sig, frame)
        log.info("signal %s: draining before exit", sig)
        self._drain_task = asyncio.get_event_loop().create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame: Any) -> None:
        await self.instance.drain()
        # In-flight work is done; what uvicorn may still wait for is an idle keep-alive
        # connection from the router, which must not hold the exit for the full 30 s.
        self.config.timeout_graceful_shutdown = 2
        super().handle_exit(sig, frame)
