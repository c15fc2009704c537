"""Make-before-break for a decode that moves mid-stream (a role switch or a drain on its
instance; EPDServe §3.2.4's migrate, without the stream's pause for the hop).

A decode handed over live (`MigratingEvent.live`) goes on decoding at its source while
its takeover (router/takeover.py) pulls the KV as of the hand-over. `Overlap` relays the
source's tokens to the client as they come and feeds each to the target
(`Takeover.feed`), which follows: it appends them and computes their KV, sampling nothing
(worker/engine/token_feed.py). Once the target has the decode in its engine (its stream's
first event, an empty `tokens` event), the overlap cuts over right after the next token
it relays from the source: `Takeover.lead` tells the target to sample from the client's
next index on, and the caller closes the source (which aborts it there) and reads the rest
from the target. The stream waits for no pull and no admission: only for the cut (a feed
call, the target's step in flight, one step).

Either side may end first: the source finishing ends the request (the target is closed);
the target finishing on fed tokens ends it too (the source ended there as well). A source
that fails or goes away before the cut leaves the target to lead at once; a target that
fails, moves on or missed a feed leaves the source to finish the decode (it keeps decoding
until its stream is closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from triptych.router.backend import TokenEvent
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.takeover import Takeover
from triptych.stage_protocol import FinishedEvent, KVSource, StageEvent, TokensEvent
from triptych.topology import Stage

log = logging.getLogger("triptych.router.overlap")

_LET_GO = None  # a side's handler returns this when that side is no longer read


class Overlap:
    """One live hand-over's merge of its source's and its target's streams (choice 0)."""

    def __init__(self, source: Instance, takeover: Takeover, kv: KVSource) -> None:
        self.source = source
        self.takeover = takeover
        self.next_index = len(kv.generated) + 1  # the client has every token before this one
        self.finished: FinishedEvent | None = None  # the request ended during the overlap...
        self.finished_by: Instance | None = None  # ...on this instance's stream
        self.took_over = False  # cut over: the target leads from `next_index`
        self._ready = False  # the target has the decode in its engine
        self._source_gone = False
        self._target_dropped = False

    async def run(self, source: AsyncIterator[StageEvent]) -> AsyncIterator[TokenEvent]:
        """Token events for the client until the cut-over (`took_over`) or the request's
        end (`finished`). Raises the target's failure if the source is gone too."""
        streams = {"source": source, "target": self.takeover.events()}
        reads = {asyncio.ensure_future(anext(stream)): side for side, stream in streams.items()}
        failure: BaseException = StageFailure(self.takeover.target, "the source and the target of a moving "
                                              "decode both ended without finishing it", stage=Stage.DECODE)
        try:
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for read in sorted(done, key=lambda r: reads[r] != "source"):  # the source's tokens first
                    side = reads.pop(read)
                    try:
                        event = read.result()
                    except StopAsyncIteration:
                        out = self._gone(side, "its stream ended")
                    except Exception as exc:  # that side failed: the other one goes on
                        out = self._gone(side, str(exc))
                        failure = exc if side == "target" else failure
                    else:
                        out = self._source(event) if side == "source" else self._target(event)
                    for token_event in out or ():
                        yield token_event
                    if self.finished is not None or self.took_over:
                        return
                    if out is not _LET_GO:
                        reads[asyncio.ensure_future(anext(streams[side]))] = side
                    if self._target_dropped:
                        for r in [r for r, s in reads.items() if s == "target"]:
                            r.cancel()
                            del reads[r]
            raise failure
        finally:
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    def _cut(self) -> None:
        """Right after a token relayed from the source (or with the source gone): the target
        leads from the client's next index; the caller closes the source."""
        self.takeover.lead(self.next_index)
        self.took_over = True

    def _gone(self, side: str, why: str) -> list[TokenEvent] | None:
        log.info("overlap of %s: the %s went (%s)", self.takeover.request_id, side, why)
        if side == "target":
            self._target_dropped = True
        else:
            self._source_gone = True
            if self._ready:
                self._lead_or_stay()
        return _LET_GO

    def _source(self, event: StageEvent) -> list[TokenEvent] | None:
        if isinstance(event, FinishedEvent):
            if event.finish_reason == "abort":  # stopped where it was (a switch's deadline)
                return self._gone("source", "aborted")
            self.finished, self.finished_by = event, self.source
        elif isinstance(event, TokensEvent):
            self.takeover.feed(self.next_index, event.token_ids)
            self.next_index += len(event.token_ids)
            if self._ready:
                self._lead_or_stay()
            return [TokenEvent(token_ids=event.token_ids, logprobs=event.logprobs)]
        return []

    def _lead_or_stay(self) -> None:
        if not self.takeover.feed_failed:
            self._cut()
        else:  # the target misses a token it would need: the source finishes the decode
            log.info("overlap of %s: a feed failed; staying with the source", self.takeover.request_id)
            self._ready, self._target_dropped = False, True
            self.takeover.close()

    def _target(self, event: StageEvent) -> list[TokenEvent] | None:
        if isinstance(event, FinishedEvent):
            self.finished, self.finished_by = event, self.takeover.target
        elif isinstance(event, TokensEvent) and not event.token_ids:  # in its engine, following
            self._ready = True
            if self._source_gone:
                self._lead_or_stay()
        elif isinstance(event, TokensEvent):  # tokens before the cut: ones it was fed, as it ended
            start = self.next_index if event.start is None else event.start
            if start + len(event.token_ids) > self.next_index:  # sampled ahead: a target that does not follow
                skip = max(0, self.next_index - start)
                self.next_index += len(event.token_ids) - skip
                self.took_over = True
                return [TokenEvent(token_ids=event.token_ids[skip:],
                                   logprobs=event.logprobs[skip:] if event.logprobs else None)]
        elif event.type in ("migrating", "precopy"):
            # The target moves on before the cut: let it go, the source goes on.
            self.takeover.close()
            return self._gone("target", "it hands the decode on")
        return []
