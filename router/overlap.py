"""Make-before-break for a decode that moves mid-stream (a role switch or a drain on its
instance; EPDServe §3.2.4's migrate, without the stream's pause for the hop).

A decode handed over live (`MigratingEvent.live`) goes on decoding at its source while
its takeover (router/takeover.py) pulls the KV as of the hand-over and admits the decode.
`Overlap` relays the source's tokens to the client meanwhile. Once the target has the
decode in its engine (its stream's first event, an empty `tokens` event saying how many
tokens it holds), the overlap catches it up: it feeds it the tokens the source streamed
since (worker/engine/token_feed.py), which the target computes in its next step, while the
client still reads the source, and says so with another empty event. When the target lacks
at most `CUT_BEHIND` tokens, the overlap cuts over right after the next token it relays
from the source: a feed with `lead` brings the last few tokens (their KV is computed with
the next sample), the target samples from the client's next index on, and the caller closes
the source (aborting it there) and reads the rest from the target. The stream waits for no
pull, no admission and no catching up — only for the cut: the lead's call, the target's
step in flight and one step of a decode a token or two behind.

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

# The cut waits until the target lacks at most this many tokens (the one just relayed
# included): the cut's step computes them with the next sample, about the cost of a plain
# decode step. Catching up from further behind (one step per round; the tokens the source
# streamed meanwhile go in the next) happens before the cut, off the client's stream; after
# MAX_CATCH_UPS rounds it cuts anyway. Not lower: a round costs the target a feed call and a
# step, and on a busy target that is several of the source's tokens (with 1, rounds began at
# 2-4 tokens behind and left 7 of 14 moved decodes 9 behind at the cut; docs/benchmarks.md).
CUT_BEHIND = 3
MAX_CATCH_UPS = 4


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
        self.target_holds = self.handed_over  # output tokens the target holds (its empty events say)
        self.catch_ups = 0  # feeds sent before the cut
        self._feeding: asyncio.Task[bool] | None = None  # the catch-up feed the target has not confirmed
        self._fed_to = 0  # the output index that feed ends at
        self._round_behind = 1 << 30  # tokens the target lacked when the last round was sent
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
                if self._ready and "target" not in self._gone:
                    if "source" in self._gone or due and self._may_cut():
                        start = self.target_holds  # what it lacks: the lead's step computes it
                        log.info("overlap of %s: cut over, the target lacking %d after %d catch-ups",
                                 self.takeover.request_id, self.next_index - start, self.catch_ups)
                        if await self.takeover.feed(start, self.relayed[start - self.handed_over:], lead=True):
                            self.took_over = True
                            return
                        self._let_go("target", "it did not take the lead")
                    elif self._feeding is None and self._rounds_pay():
                        self._catch_up()
                for r in [r for r, s in reads.items() if s in self._gone]:
                    r.cancel()
                    del reads[r]
            raise failure
        finally:
            if self._feeding is not None:
                self._feeding.cancel()
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            if self.took_over:  # what the target streamed meanwhile is the caller's to read
                for read, side in reads.items():
                    if side == "target" and not read.cancelled():
                        self.takeover.unread(_outcome(read))

    def _may_cut(self) -> bool:
        """Whether the target is close enough behind for the cut (or has had its rounds);
        a catch-up feed it did not take lets it go."""
        feeding = self._feeding
        if feeding is not None and feeding.done() and not feeding.result():
            self._let_go("target", "it did not take the tokens fed to it")
            return False
        return feeding is None and not self._rounds_pay() or self.catch_ups >= MAX_CATCH_UPS

    def _rounds_pay(self) -> bool:
        """Whether another catch-up round is worth it: the target lacks more than CUT_BEHIND
        tokens, and fewer than when the last round was sent (a target whose steps are slower
        than the source's stays a few behind, however many rounds it gets)."""
        behind = self.next_index - self.target_holds
        return CUT_BEHIND < behind < self._round_behind and self.catch_ups < MAX_CATCH_UPS

    def _catch_up(self) -> None:
        """Feed the target what it lacks, without the lead; its next empty event says it is in."""
        start, self._fed_to = self.target_holds, self.next_index
        self._round_behind = self._fed_to - start
        self.catch_ups += 1
        self._feeding = asyncio.ensure_future(self.takeover.feed(start, self.relayed[start - self.handed_over:]))

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
            if event.start is not None:
                self.target_holds = max(self.target_holds, event.start)
            if self._feeding is not None and self.target_holds >= self._fed_to:
                self._feeding = None  # in: what the source streamed since is the next round
        elif event.type in ("migrating", "precopy"):  # it moves on before the cut
            self._let_go("target", "it hands the decode on")
        return []


def _outcome(read: asyncio.Future[StageEvent]) -> object:
    """A finished read of the target's stream as `Takeover.unread` takes it."""
    exc = read.exception()
    if isinstance(exc, StopAsyncIteration):
        return END
    return exc if exc is not None else read.result()
