"""Make-before-break for a decode that moves mid-stream (a role switch or a drain on its
instance; EPDServe §3.2.4's migrate, without the stream's pause for the hop).

A decode handed over live (`MigratingEvent.live`) goes on decoding at its source while
its takeover (router/takeover.py) pulls the KV as of the hand-over, admits the decode and
samples it too. `Overlap` relays the source's tokens to the client meanwhile and feeds each
to the target (`Takeover.feed`: it takes them in at its next step, computing their KV in one
chunk, so it catches up however far behind it is; worker/engine/token_feed.py). The target's
tokens come by output index and are checked against what the client got, and after each
step in which it took fed tokens in it says which index it samples next (an event without
tokens). The overlap cuts over as soon as the target has caught up: a target token the
client lacks goes to the client at once (the target got ahead: the hop costs the stream
nothing), or the target is level with the client (its step now computes the client's next
token: the stream waits for that step alone, not for a call, a step in flight and a step). A target
still behind after `MAX_BEHIND` of its tokens is cut over to anyway (its next step takes
in what it lacks). The caller then closes the source (aborting it there) and reads the rest
from the target, which drops what the client already has (`Takeover.expect`).

Either side may end first: the source finishing ends the request (the target is closed);
a source that fails or is stopped before the cut (a switch's deadline) leaves the target
to lead as soon as it is ready. A target that fails, moves on or samples a token the client
did not get at that index is let go, and the source finishes the decode (it keeps decoding
until its stream is closed).
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


MAX_BEHIND = 8  # target tokens that find it behind the client before the cut is forced


class Overlap:
    """One live hand-over's merge of its source's and its target's streams (choice 0)."""

    def __init__(self, source: Instance, takeover: Takeover, kv: KVSource) -> None:
        self.source = source
        self.takeover = takeover
        self.handed_over = len(kv.generated) + 1  # output tokens when the source handed over
        self.relayed: list[int] = []  # the tokens the client got since, in order
        self.finished: FinishedEvent | None = None  # the request ended during the overlap...
        self.finished_by: Instance | None = None  # ...on this instance's stream
        self.took_over = False  # cut over: the rest comes from the target
        self.cut_index: int | None = None  # the output index of the client's first token from the target
        self._ready = False  # the target has the decode in its engine
        self._gone: set[str] = set()  # sides no longer read
        self._cut_due = False  # the target caught up with the client
        self._behind = 0  # target tokens that came while it was behind

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
                    self._cut()
                    return
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

    def _cut(self) -> None:
        """Cut over to the target: it has every token the client got, or is fed them (the
        lead records where the cut is); what it streams of them is dropped from now on."""
        if self.cut_index is None:
            self.cut_index = self.next_index
        log.info("overlap of %s: cut over at output index %d (%d tokens from the source, %d behind before)",
                 self.takeover.request_id, self.cut_index, self.cut_index - self.handed_over, self._behind)
        lead = self.relayed[:self.cut_index - self.handed_over]
        self.takeover.feed(self.handed_over, lead, lead=True)
        self.takeover.expect(self.handed_over, self.relayed)
        self.took_over = True

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
        elif isinstance(event, TokensEvent) and event.token_ids:
            if "target" not in self._gone:
                self.takeover.feed(self.next_index, event.token_ids)
            self.relayed += event.token_ids
            return [TokenEvent(token_ids=event.token_ids, logprobs=event.logprobs)]
        return []

    def _target(self, event: StageEvent) -> list[TokenEvent]:
        if isinstance(event, FinishedEvent):  # before the cut: it ended as the source did
            self.finished, self.finished_by = event, self.takeover.target
        elif isinstance(event, TokensEvent) and event.token_ids:
            self._ready = True
            return self._target_tokens(event)
        elif isinstance(event, TokensEvent) and not self._ready:
            # In its engine. Not cut over to yet even if level: its first step (the joining
            # one, slower than any after it) races the source's next step instead.
            self._ready = True
        elif isinstance(event, TokensEvent):
            # It took fed tokens in: its next step samples output index `start`. The
            # client's next one: level, the cut.
            self._cut_due = event.start == self.next_index
        elif event.type in ("migrating", "precopy"):  # it moves on before the cut
            self._let_go("target", "it hands the decode on")
        return []

    def _target_tokens(self, event: TokensEvent) -> list[TokenEvent]:
        """Tokens the target sampled, by output index: those the client has must match; any
        it lacks go to it now and the cut follows, as it does once the target is level."""
        start = event.start
        if start is None or not self.handed_over <= start <= self.next_index:  # a gap cannot happen
            self._let_go("target", f"its tokens start at output index {start}, not in [{self.handed_over}, "
                                   f"{self.next_index}]")
            return []
        known = min(len(event.token_ids), self.next_index - start)  # the client has these
        if event.token_ids[:known] != self.relayed[start - self.handed_over:start - self.handed_over + known]:
            self._let_go("target", "it sampled a token the client did not get at that index")
            return []
        ahead = event.token_ids[known:]
        if ahead:
            self.cut_index = self.next_index
            self.relayed += ahead
            self._cut_due = True
            return [TokenEvent(token_ids=ahead, logprobs=event.logprobs[known:] if event.logprobs else None)]
        if start + known == self.next_index:  # level with the client: its step in flight samples the next
            self._cut_due = True
        else:
            self._behind += 1
            self._cut_due = self._behind >= MAX_BEHIND
        return []


def _outcome(read: asyncio.Future[StageEvent]) -> object:
    """A finished read of the target's stream as `Takeover.unread` takes it."""
    exc = read.exception()
    if isinstance(exc, StopAsyncIteration):
        return END
    return exc if exc is not None else read.result()
