"""The target side of a live-migrated decode (`POST /internal/takeover`).

A decode instance that is about to move a running decode (a role switch or a drain) first
offers the KV blocks already full (a `precopy` event) and keeps decoding; the router then
opens the decode's next hop here with an NDJSON request body sent in two parts (Clark et
al., "Live Migration of Virtual Machines", NSDI '05 §3: pre-copy, then stop-and-copy):

1. the hop's `StageRequest`, its kv_source the full blocks: they are pulled into this
   instance's prefix cache at once (`MigrationService.precopy_kv`) while the source goes on;
2. once the source has stopped the decode, its hand-over `KVSource` (all its blocks, the
   tokens so far), on the connection already open: the run then goes on as any decode
   hop, and its pull finds the pre-copied blocks cached and reads only the rest.

A source that hands the decode over live (make-before-break, `MigratingEvent.live`, the
hand-over's `live`) goes on decoding meanwhile; the decode here follows (samples nothing)
until the router cuts over with the tokens the source streamed since (`POST
/internal/feed`, `feed`, one call for the cut-overs due here together; worker/engine/token_feed.py).

Nothing is held between the two: pre-copied blocks sit unreferenced in the prefix cache
(evictable), so a hand-over that never comes leaks nothing.

Each takeover's moments (wall clock: opened, pre-copied, handed over, admitted to the engine
with its KV pulled, led — a live one's cut-over, with the output index it samples from and
the feeds its call brought —, first token out) are kept for the last `TAKEOVER_RECORDS` in
`/admin/stats` `recent_takeovers`; `bench switch` lines them up with the source's park and
the client's tokens (where a hop's time goes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from triptych.stage_protocol import FeedRequest, HandOver, KVSource, StageRequest
from triptych.topology import Stage
from triptych.worker.engine.token_feed import TokenFeed
from triptych.worker.errors import BadPayloadError
from triptych.worker.instance import InstanceRuntime
from triptych.worker.migration import MigrationError

log = logging.getLogger("triptych.worker.takeover")


class NoHandOverError(BadPayloadError):
    """The router closed the takeover without sending the hand-over (the decode finished
    at its source, or the client went away)."""


async def receive(inst: InstanceRuntime, lines: AsyncIterator[bytes]) -> StageRequest:
    """Read the hop, pre-copy its full blocks, wait for the hand-over: the decode hop to run
    (its kv_source the hand-over). Raises BadPayloadError (a 4xx; the router drops the hop)
    for a malformed or missing part."""
    try:
        sreq = StageRequest.model_validate_json(await anext(lines))
    except (StopAsyncIteration, ValidationError) as exc:
        raise BadPayloadError(f"takeover: no valid stage request first: {exc}") from exc
    if sreq.kv_source is None or sreq.stages != [Stage.DECODE]:
        raise BadPayloadError("takeover: a decode hop with the pre-copied blocks as kv_source comes first")
    inst.feeds[sreq.request_id] = TokenFeed()  # dropped when the run ends, or here on failure
    try:
        return await _receive(inst, sreq, lines)
    except BaseException:
        inst.feeds.pop(sreq.request_id, None)
        raise


async def _receive(inst: InstanceRuntime, sreq: StageRequest, lines: AsyncIterator[bytes]) -> StageRequest:
    moments = {"request_id": sreq.request_id, "opened_at": time.time(), "precopied_at": None,
               "handed_over_at": None, "admitted_at": None, "first_token_at": None, "fed_tokens": 0,
               "feeds": 0, "led_at": None, "lead_index": None, "lead_batch": None}
    inst.takeovers.append(moments)
    await _precopy(inst, sreq, sreq.kv_source)
    moments["precopied_at"] = time.time()
    try:
        async with asyncio.timeout(sreq.timeout_s):
            tail = HandOver.model_validate_json(await anext(lines))
    except (StopAsyncIteration, TimeoutError) as exc:
        raise NoHandOverError(f"takeover of {sreq.request_id}: no hand-over came") from exc
    except ValidationError as exc:
        raise BadPayloadError(f"takeover: the hand-over is no KV source: {exc}") from exc
    moments["handed_over_at"] = time.time()
    if not tail.live:  # the source stopped the decode: nothing to follow
        inst.feeds.pop(sreq.request_id, None)
    return sreq.model_copy(update={"kv_source": KVSource.model_validate(tail.model_dump(exclude={"live"}))})


def feed(inst: InstanceRuntime, body: FeedRequest, batch: int = 1) -> bool:
    """Tokens the source of a live takeover here streamed after its hand-over (with `lead`,
    the cut-over): the decode takes them at its next step. False when no live takeover of
    that id runs here (it ended, or was no live one). `batch`: the feeds in the call that
    brought it (router/feeds.py), kept with a lead."""
    token_feed = inst.feeds.get(body.request_id)
    if token_feed is None:
        return False
    token_feed.put(body.start, body.token_ids, body.lead)
    moments = _moments(inst, body.request_id)
    if moments is not None:
        moments["fed_tokens"] += len(body.token_ids)
        moments["feeds"] += 1  # calls it took (the lead is one)
        if body.lead:  # the cut-over: the stream's tokens from this index on are ours
            moments["led_at"], moments["lead_index"] = time.time(), body.start + len(body.token_ids)
            moments["lead_batch"] = batch
    if inst.engine is not None:
        inst.engine.driver.wake()
    return True


def mark(inst: InstanceRuntime, request_id: str, moment: str) -> None:
    """A later moment of a takeover's hop, the first time it comes (`stage_run.stream`):
    `admitted_at`, its KV pulled and the decode handed to the engine; `first_token_at`, its
    first token here on the way to the router. Nothing for a decode hop that was no
    takeover."""
    moments = _moments(inst, request_id)
    if moments is not None:
        moments[moment] = moments.get(moment) or time.time()


def _moments(inst: InstanceRuntime, request_id: str) -> dict[str, Any] | None:
    """The record of the latest takeover of `request_id` here (None: none kept)."""
    return next((m for m in reversed(inst.takeovers) if m["request_id"] == request_id), None)


async def _precopy(inst: InstanceRuntime, sreq: StageRequest, kv: KVSource) -> None:
    """Best effort: a pre-copy that fails (or an instance not serving decodes any more)
    leaves the hand-over to pull every block, or to be refused by `prepare`."""
    engine, migration = inst.engine, inst.migration
    if engine is None or migration is None or inst.draining or inst.switching or not engine.role.runs(Stage.DECODE):
        return
    inst.preparing += 1  # a switch waits for it: the blocks it fills are this role's cache's
    try:
        pulled, held = await migration.precopy_kv(kv, sreq.prompt_token_ids, sreq.mm_items)
        log.debug("takeover of %s: pre-copied %d blocks (%d held already)", sreq.request_id, pulled, held)
    except MigrationError as exc:
        log.info("takeover of %s: pre-copy failed (%s); the hand-over pulls every block", sreq.request_id, exc)
    finally:
        inst.preparing -= 1
