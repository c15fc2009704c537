"""The router's side of the event channels (triptych/stage_protocol.py): one held open to
each worker that offers them, on which the events of every run the router posts there
arrive, tagged; `StageClient.run` reads its run's events from here instead of from the
run's own response.

A worker without channels (404: an older build, a test double) gets a stream per run, as
does any worker while its channel cannot be opened (tried again after OPEN_RETRY_S). A
channel that ends — the worker exited, or went silent past its keep-alives — ends every
run reading it with a transport error, which StageClient sorts like a dropped stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx

from triptych.stage_protocol import CHANNEL_KEEPALIVE_S, CHANNEL_PATH, split_channel_line

log = logging.getLogger("triptych.router.stage_channel")

OPEN_RETRY_S = 5.0  # a channel that failed to open is not tried again for this long
_CLOSED = object()  # queued for every run still reading a channel that ended


class Channel:
    """One open channel: its reader task hands each line to its run's queue."""

    def __init__(self, url: str, cid: str, resp: httpx.Response) -> None:
        self.url = url
        self.cid = cid
        self.alive = True
        self.reason = ""
        self._resp = resp
        self._runs: dict[str, asyncio.Queue[object]] = {}
        self._tags = itertools.count()
        self._reader = asyncio.create_task(self._read())

    def subscribe(self) -> str:
        """A tag for a run about to be posted: its events queue from now on."""
        tag = str(next(self._tags))
        self._runs[tag] = asyncio.Queue()
        if not self.alive:
            self._runs[tag].put_nowait(_CLOSED)
        return tag

    def unsubscribe(self, tag: str) -> None:
        self._runs.pop(tag, None)

    async def lines(self, tag: str, read_timeout_s: float) -> AsyncIterator[str]:
        """The run's event lines until its end; httpx's errors for silence and a closed channel."""
        queue = self._runs[tag]
        while True:
            try:
                async with asyncio.timeout(read_timeout_s):
                    item = await queue.get()
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"no event for {read_timeout_s}s on channel {self.cid}") from exc
            if item is _CLOSED:
                raise httpx.RemoteProtocolError(f"event channel to {self.url} closed: {self.reason}")
            if item == "":
                return
            yield str(item)

    async def _read(self) -> None:
        try:
            async for line in self._resp.aiter_lines():
                parts = split_channel_line(line)
                if parts is not None and (queue := self._runs.get(parts[0])) is not None:
                    queue.put_nowait(parts[1])
            self.reason = "the worker ended it"
        except httpx.HTTPError as exc:
            self.reason = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            self.reason = "the router closed it"
            raise
        finally:
            self.alive = False
            for queue in self._runs.values():
                queue.put_nowait(_CLOSED)
            log.debug("event channel %s to %s closed: %s", self.cid, self.url, self.reason)
            await self._resp.aclose()

    async def aclose(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class ChannelPool:
    """The router's channels, one per worker URL, opened on first use."""

    def __init__(self, client: httpx.AsyncClient, enabled: bool = True) -> None:
        self.client = client
        self.enabled = enabled
        self._open: dict[str, Channel] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._unsupported: set[str] = set()
        self._retry_at: dict[str, float] = {}

    async def get(self, url: str) -> Channel | None:
        """The open channel to `url`, opened now if need be; None: use a stream per run."""
        if not self.enabled or url in self._unsupported:
            return None
        channel = self._open.get(url)
        if channel is not None and channel.alive:
            return channel
        if time.monotonic() < self._retry_at.get(url, 0.0):
            return None
        async with self._locks.setdefault(url, asyncio.Lock()):
            channel = self._open.get(url)
            if channel is not None and channel.alive:
                return channel
            return await self._open_one(url)

    def forget(self, channel: Channel) -> None:
        """`channel` is no longer open on its worker (it said so): the next run reopens."""
        channel.alive = False
        if self._open.get(channel.url) is channel:
            del self._open[channel.url]

    async def _open_one(self, url: str) -> Channel | None:
        cid = uuid.uuid4().hex
        timeout = httpx.Timeout(connect=5.0, read=4 * CHANNEL_KEEPALIVE_S, write=5.0, pool=5.0)
        try:
            request = self.client.build_request("POST", f"{url}{CHANNEL_PATH}", params={"id": cid}, timeout=timeout)
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.debug("no event channel to %s: %s", url, exc)
            self._retry_at[url] = time.monotonic() + OPEN_RETRY_S
            return None
        if resp.status_code != 200:
            try:
                await resp.aread()  # a small error body: read, the connection goes back to the pool
            except httpx.HTTPError:
                pass
            finally:
                await resp.aclose()
            if resp.status_code in (404, 405):
                log.info("%s offers no event channel: a stream per run", url)
                self._unsupported.add(url)
            else:
                self._retry_at[url] = time.monotonic() + OPEN_RETRY_S
            return None
        channel = self._open[url] = Channel(url, cid, resp)
        return channel

    async def aclose(self) -> None:
        channels, self._open = list(self._open.values()), {}
        await asyncio.gather(*(c.aclose() for c in channels))
