"""Live-migration pre-copy of a decode about to move (a role switch or a drain on its
instance; EPDServe §3.2.4 migrate, done as Clark et al., "Live Migration of Virtual
Machines", NSDI '05 §3: pre-copy while running, then stop-and-copy of the rest).

The decode's instance sends a `precopy` event with a handle on the KV blocks already full
and keeps decoding. The router picks the instance the decode will go on at and has it pull
those blocks now (`POST /internal/precopy`, into its prefix cache); when the `migrating`
event comes, the decode hop goes to that instance, which pulls only the blocks filled
since. A pre-copy that fails costs nothing but its head start: the hand-over then goes to
any decode instance and pulls every block, as without one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from triptych.router.registry import Instance, Registry
from triptych.router.stage_client import StageClient, StageFailure
from triptych.stage_protocol import KVSource, MMItemSpec, PrecopyRequest
from triptych.topology import Stage

log = logging.getLogger("triptych.router.precopy")


class Precopy:
    """One decode's pre-copy, running in the background while its stream goes on."""

    def __init__(self, task: asyncio.Task[Instance | None]) -> None:
        self._task = task

    async def target(self, timeout_s: float) -> Instance | None:
        """The instance that holds the pre-copied blocks, once the pull is done (waiting at
        most `timeout_s`: the source stops the decode once the pull is confirmed, so it is
        normally done already); None if it failed or is not done by then."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            if not self._task.done():
                log.info("pre-copy still running at the hand-over; handing over without it")
            return None


class Precopier:
    """Starts pre-copies (`start`) and keeps their tasks referenced until done."""

    def __init__(self, registry: Registry, stages: StageClient, choose: Callable[[list[Instance]], Instance],
                 timeout_s: float) -> None:
        self.registry, self.stages, self.choose = registry, stages, choose
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[Instance | None]] = set()

    def start(self, request_id: str, prompt_token_ids: list[int], mm_items: list[MMItemSpec], kv: KVSource,
              exclude: set[str]) -> Precopy:
        """Pick the decode instance (none of `exclude`: the source, instances the decode
        left) and have it pull `kv`'s blocks."""
        body = PrecopyRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, mm_items=mm_items, kv=kv)
        task = asyncio.create_task(self._run(body, set(exclude)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return Precopy(task)

    async def _run(self, body: PrecopyRequest, exclude: set[str]) -> Instance | None:
        candidates = self.registry.capable(Stage.DECODE, exclude)
        if not candidates:
            return None
        target = self.choose(candidates)
        try:
            reply = await self.stages.precopy(target, body, self.timeout_s)
        except StageFailure as failure:
            log.info("request %s: pre-copy to %s failed (%s); the hand-over pulls every block",
                     body.request_id, target.url, failure)
            return None
        log.debug("request %s: pre-copied %d blocks to %s (%d held)", body.request_id, reply.pulled_blocks,
                  target.url, reply.held_blocks)
        return target
