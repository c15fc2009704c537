"""Feeds to live takeovers, one call per instance for the feeds due together.

A role switch or a drain moves every decode off its instance at the same step boundary,
so their cut-overs (router/overlap.py) come due on the same source step. Sent one call
each, they queue up at the target — an instance on a capped share of a CPU (`serve
--instance-cpus`) handles each call between its engine's steps, and eight cut-overs
measured 25-115 ms from send to answer there, most of it waiting behind the calls ahead.
`FeedBatcher` gathers the feeds for one instance for `FEED_BATCH_WINDOW_S` and sends them
in one `POST /internal/feed` (`FeedBatch`), whose answer says which each took.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import ValidationError

from triptych.stage_protocol import MAX_FEEDS, FeedBatch, FeedReply, FeedRequest

log = logging.getLogger("triptych.router.feeds")

FEED_TIMEOUT_S = 2.0  # a target that did not take its feed in this is never cut over to
FEED_BATCH_WINDOW_S = 0.001  # how long a first feed waits for others to the same instance


class FeedBatcher:
    """Sends feeds to instances, those due within a window together (one per router)."""

    def __init__(self, client: httpx.AsyncClient, window_s: float = FEED_BATCH_WINDOW_S) -> None:
        self._client = client
        self._window_s = window_s
        self._pending: dict[str, list[tuple[FeedRequest, asyncio.Future[bool]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, url: str, feed: FeedRequest) -> bool:
        """Feed a takeover on the instance at `url`: whether it took the feed (False also
        when the call failed or timed out)."""
        taken: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        batch = self._pending.setdefault(url, [])
        batch.append((feed, taken))
        if len(batch) == 1:
            task = asyncio.create_task(self._flush(url))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(taken)  # a cancelled caller leaves the batch to the rest

    async def _flush(self, url: str) -> None:
        batch: list[tuple[FeedRequest, asyncio.Future[bool]]] = []
        try:
            await asyncio.sleep(self._window_s)
            batch = self._pending.pop(url, [])
            for at in range(0, len(batch), MAX_FEEDS):
                part = batch[at:at + MAX_FEEDS]
                for (_, future), ok in zip(part, await self._post(url, [f for f, _ in part]), strict=True):
                    if not future.done():
                        future.set_result(ok)
        finally:  # cancelled (the router stopping): nobody waits for ever
            for _, future in batch or self._pending.pop(url, []):
                if not future.done():
                    future.set_result(False)

    async def _post(self, url: str, feeds: list[FeedRequest]) -> list[bool]:
        body = FeedBatch(feeds=feeds).model_dump_json()
        try:
            resp = await self._client.post(f"{url}/internal/feed", content=body, timeout=FEED_TIMEOUT_S,
                                           headers={"content-type": "application/json"})
            if resp.status_code == 200:
                reply = FeedReply.model_validate_json(resp.content)
                if len(reply.taken) == len(feeds):
                    return reply.taken
            log.info("feeds to %s: HTTP %d: %s", url, resp.status_code, resp.text[:200])
        except (httpx.HTTPError, ValidationError) as exc:
            log.info("feeds to %s failed: %s", url, exc)
        return [False] * len(feeds)
