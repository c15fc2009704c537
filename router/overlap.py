"""Make-before-break for a decode that moves mid-stream (a role switch or a drain on its
instance; EPDServe §3.2.4's migrate, without the stream's pause for the hop).

A decode handed over live (`MigratingEvent.live`) goes on decoding at its source while
its takeover (router/takeover.py) pulls the KV as of the hand-over and admits the decode.
`Overlap` relays the source's tokens to the client meanwhile. Once the target has the
decode in its engine (its stream's first event, an empty `tokens` event), the overlap
cuts over right after the next token it relays from the source: `Takeover.lead` sends
the target the tokens the source streamed since the hand-over (worker/engine/
token_feed.py: their KV is computed with the next sample), the target samples from the
client's next index on, and the caller closes the source (aborting it there) and reads
the rest from the target. The stream waits for no pull and no admission — only for the
cut: the lead's call, the target's step in flight and one step.

Either side may end first: the source finishing ends the request (the target is closed);
a source that fails or is stopped before the cut (a switch's deadline) leaves the target
to lead as soon as it is ready. A target that fails, moves on or does not take the lead
is let go, and the source finishes the decode (it keeps decoding until its stream is
closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from triptych.router.backend import TokenEvent
from triptych.router.registry import Instance
from triptych.router.stage_client import StageFailure
from triptych.router.takeover import END, Takeover
from triptych.stage_protocol import FinishedEvent, KVSource, StageEvent, TokensEvent
from triptych.topology import Stage

log = logging.getLogger("triptych.router.overlap")


class Overlap:
    """One live hand-over's merge of its source's and its target's streams (choice 0)."""

    def __init__(self, source: Instance, takeover: Takeover, kv: KVSource) -> None:
        self.source = source
        self.takeover = takeover
        self.handed_over = len(kv.generated) + 1  # output tokens when the source handed over
        self.relayed: list[int] = []  # the source's tokens since, as the client got them
        self.finished: FinishedEvent | None = None  # the request ended during the overlap...
        self.finished_by: Instance | None = None  # ...on this instance's stream
        self.took_over = False  # cut over: the target samples from `next_index`
        self._ready = False  # the target has the decode in its engine
        self._gone: set[str] = set()  # sides no longer read
        self._cut_due = False  # a token was just relayed from the source, the target ready

    @property
    def next_index(self) -> int:
        """The output index of the next token the client lacks."""
        return self.handed_over + len(self.relayed)

    async def run(self, source: AsyncIterator[StageEvent]) -> AsyncIterator[TokenEvent]:
        """Token events for the client until the cut-over (`took_over`) or the request's
        end (`finished`). Raises a failure when both streams are gone."""
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
                        self._let_go(side, "its stream ended")
                        continue
                    except Exception as exc:
                        self._let_go(side, str(exc))
                        failure = exc if side == "target" else failure
                        continue
                    for token_event in self._source(event) if side == "source" else self._target(event):
                        yield token_event
                    if self.finished is not None:
                        return
                    if side not in self._gone:
                        reads[asyncio.ensure_future(anext(streams[side]))] = side
                due, self._cut_due = self._cut_due, False
                if self._ready and "target" not in self._gone and ("source" in self._gone or due):
                    log.info("overlap of %s: cut over after %d tokens from the source",
                             self.takeover.request_id, len(self.relayed))
                    if await self.takeover.lead(self.handed_over, self.relayed):
                        self.took_over = True
                        return
                    self._let_go("target", "it did not take the lead")
                for r in [r for r, s in reads.items() if s in self._gone]:
                    r.cancel()
                    del reads[r]
            raise failure
        finally:
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            if self.took_over:  # what the target streamed meanwhile is the caller's to read
                for read, side in reads.items():
                    if side == "target" and not read.cancelled():
                        self.takeover.unread(_outcome(read))

    def _let_go(self, side: str, why: str) -> None:
        log.info("overlap of %s: the %s went (%s)", self.takeover.request_id, side, why)
        self._gone.add(side)
        if side == "target":
            self._ready = False
            self.takeover.close()

    def _source(self, event: StageEvent) -> list[TokenEvent]:
        if isinstance(event, FinishedEvent):
            if event.finish_reason == "abort":  # stopped where it was (a switch's deadline)
                self._let_go("source", "aborted")
            else:
                self.finished, self.finished_by = event, self.source
        elif isinstance(event, TokensEvent):
            self.relayed += event.token_ids
            self._cut_due = self._ready
            return [TokenEvent(token_ids=event.token_ids, logprobs=event.logprobs)]
        return []

    def _target(self, event: StageEvent) -> list[TokenEvent]:
        if isinstance(event, FinishedEvent):  # before the cut: it ended as the source did
            self.finished, self.finished_by = event, self.takeover.target
        elif isinstance(event, TokensEvent) and not event.token_ids:  # in its engine, following
            self._ready = True
        elif event.type in ("migrating", "precopy"):  # it moves on before the cut
            self._let_go("target", "it hands the decode on")
        return []


def _outcome(read: asyncio.Future[StageEvent]) -> object:
    """A finished read of the target's stream as `Takeover.unread` takes it."""
    exc = read.exception()
    if isinstance(exc, StopAsyncIteration):
        return END
    return exc if exc is not None else read.result()
