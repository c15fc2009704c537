"""Make-before-break for a decode that moves mid-stream (a role switch or a drain on its
instance; EPDServe §3.2.4's migrate, without the stream's pause for the hop).

A decode handed over live (`MigratingEvent.live`) goes on decoding at its source while
its takeover (router/takeover.py) pulls the KV as of the hand-over and admits the decode.
`Overlap` relays the source's tokens to the client meanwhile. Once the target has the
decode in its engine (its stream's first event, an empty `tokens` event), the overlap
leads it at once: `Takeover.lead` sends the tokens the client got since the hand-over
(worker/engine/token_feed.py: their KV is computed with the next sample) and the target
samples from there on, streaming its tokens by output index, while the source goes on.
The two race: each index reaches the client from whichever side has it first, and every
token of the target's that the client already has must be the one the client got (else
the target is let go). A target still behind when it streams is led again with what it
lacks, so it skips ahead. The overlap cuts over as soon as the target has caught up —
it streamed the client's last token (`level`) or one the client lacks (`ahead`) — so the
stream's gap at the cut is the target's own next step. Cutting right after a token from
the source instead (the lead's trip, the target's step in flight, then its catch-up
step) measured 45-108 ms at a quarter of a core (docs/benchmarks.md).

A target that has not caught up after `RACE_TOKENS` more tokens from the source (it runs
slower than the source), or a source that fails or is stopped (a switch's deadline),
`break`s the race: the target is led to the client's next index and the caller closes
the source and reads the rest from the target, whose tokens before that index
`Takeover.resume` checks and drops. Every cut ends with a lead to the client's next index
(for a `level` or `ahead` cut, sent without waiting): the target's `recent_takeovers`
`lead_index` says where the stream became its own.

Either side may end first: the source finishing ends the request (the target is closed);
a target that fails, moves on, differs or does not take a lead is let go, and the source
finishes the decode (it keeps decoding until its stream is closed).
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

RACE_TOKENS = 8  # tokens the source may stream after the first lead before the race breaks


class Overlap:
    """One live hand-over's merge of its source's and its target's streams (choice 0)."""

    def __init__(self, source: Instance, takeover: Takeover, kv: KVSource) -> None:
        self.source = source
        self.takeover = takeover
        self.handed_over = len(kv.generated) + 1  # output tokens when the source handed over
        self.relayed: list[int] = []  # every token the client got since, from either side
        self.finished: FinishedEvent | None = None  # the request ended during the overlap...
        self.finished_by: Instance | None = None  # ...on this instance's stream
        self.took_over = False  # cut over: the rest is the target's, from `next_index`
        self.cut: str | None = None  # how: "ahead", "level" or "break"
        self._ready = False  # the target has the decode in its engine
        self._gone: set[str] = set()  # sides no longer read
        self._target_next: int | None = None  # the index after the target's last streamed token
        self._raced_from: int | None = None  # len(relayed) at the first lead
        self._lead: asyncio.Future[bool] | None = None  # a lead in flight
        self._led_with = -1  # len(relayed) at the last lead sent...
        self._taken_with = -1  # ...and at the last one the target took
        self._from_source = False  # a token was just relayed from the source
        self._behind = False  # the target just streamed, two or more tokens behind the client
        self._cut_at: int | None = None  # the output index of the client's first token from the target

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
                waits = [*reads, self._lead] if self._lead is not None else list(reads)
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                self._lead_answered()
                for read in sorted(done & reads.keys(), key=lambda r: reads[r] != "source"):  # source first
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
                    if self.finished is not None or self.took_over:
                        return
                    if side not in self._gone:
                        reads[asyncio.ensure_future(anext(streams[side]))] = side
                if await self._step():
                    return
                for r in [r for r, s in reads.items() if s in self._gone]:
                    r.cancel()
                    del reads[r]
            raise failure
        finally:
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            if self.took_over:
                self._hand_on(reads)
            elif self._lead is not None:
                self._lead.cancel()

    def _hand_on(self, reads: dict[asyncio.Future[StageEvent], str]) -> None:
        """The cut: what the target streamed meanwhile is the caller's to read, less the
        tokens the client has (`Takeover.resume`); the target learns where the cut was."""
        log.info("overlap of %s: cut over (%s) after %d tokens since the hand-over", self.takeover.request_id,
                 self.cut, len(self.relayed))
        self.takeover.resume(self.handed_over, self.relayed)
        for read, side in reads.items():
            if side == "target" and not read.cancelled():
                self.takeover.unread(_outcome(read))
        assert self._cut_at is not None
        if self._led_with != self._cut_at - self.handed_over:  # where the target's stream begins
            self.takeover.lead_later(self.handed_over, self.relayed[:self._cut_at - self.handed_over])

    async def _step(self) -> bool:
        """After a round of events: lead the target (first, or again when it is behind), or
        break the race. True once the target leads (`took_over`)."""
        from_source, self._from_source = self._from_source, False
        if not self._ready or "target" in self._gone:
            return False
        raced = len(self.relayed) - self._raced_from if self._raced_from is not None else 0
        if "source" in self._gone or (from_source and raced >= RACE_TOKENS):
            return await self._break()
        if self._lead is None and (self._raced_from is None or (self._behind and self._led_with < len(self.relayed))):
            self._raced_from = len(self.relayed) if self._raced_from is None else self._raced_from
            self._send_lead()
        return False

    async def _break(self) -> bool:
        """The target takes over from the client's next index, caught up or not."""
        if self._lead is None and self._taken_with == len(self.relayed):  # it has all it needs
            self._cut_over("break")
            return True
        if self._lead is not None and self._led_with == len(self.relayed):
            lead = self._lead  # the lead in flight says it all
        else:
            if self._lead is not None:
                self._lead.cancel()
            self._send_lead()
            lead = self._lead
        assert lead is not None
        taken = await asyncio.shield(lead)
        self._lead = None
        if taken:
            self._cut_over("break")
            return True
        self._let_go("target", "it did not take the lead")
        return False

    def _cut_over(self, how: str) -> None:
        self.took_over, self.cut, self._cut_at = True, how, self.next_index

    def _send_lead(self) -> None:
        self._led_with, self._behind = len(self.relayed), False
        self._lead = asyncio.ensure_future(self.takeover.lead(self.handed_over, list(self.relayed)))

    def _lead_answered(self) -> None:
        lead = self._lead
        if lead is None or not lead.done():
            return
        self._lead = None
        if lead.cancelled() or lead.exception() is not None or not lead.result():
            self._let_go("target", "it did not take the lead")
        else:
            self._taken_with = self._led_with

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
            self._from_source = True
            return [TokenEvent(token_ids=event.token_ids, logprobs=event.logprobs)]
        return []

    def _target(self, event: StageEvent) -> list[TokenEvent]:
        if isinstance(event, FinishedEvent):  # before the cut: it ended where the client's stream is
            self.finished, self.finished_by = event, self.takeover.target
        elif isinstance(event, TokensEvent) and not event.token_ids:  # in its engine, following
            self._ready = True
        elif isinstance(event, TokensEvent):
            return self._race(event)
        elif event.type in ("migrating", "precopy"):  # it moves on before the cut
            self._let_go("target", "it hands the decode on")
        return []

    def _race(self, event: TokensEvent) -> list[TokenEvent]:
        """Tokens the target sampled (output indices from `event.start`): those the client
        has must match; the first it lacks comes from the target, and the cut is there."""
        start = event.start
        if start is None or not self.handed_over <= start <= self.next_index:
            self._let_go("target", f"its tokens start at index {start}, the client's next is {self.next_index}")
            return []
        known = min(len(event.token_ids), self.next_index - start)
        offset = start - self.handed_over
        if event.token_ids[:known] != self.relayed[offset:offset + known]:
            self._let_go("target", f"its tokens from index {start} differ from the source's")
            return []
        self._target_next = start + len(event.token_ids)
        fresh = event.token_ids[known:]
        if not fresh:
            if self._target_next == self.next_index:
                self._cut_over("level")
            # One behind, its step in flight samples that token itself: only a longer lag
            # is worth a lead (each is a call the target's event loop answers).
            self._behind = self.next_index - self._target_next >= 2
            return []
        self._cut_over("ahead")
        self.relayed += fresh
        return [TokenEvent(token_ids=fresh, logprobs=event.logprobs[known:] if event.logprobs else None)]


def _outcome(read: asyncio.Future[StageEvent]) -> object:
    """A finished read of the target's stream as `Takeover.unread` takes it."""
    exc = read.exception()
    if isinstance(exc, StopAsyncIteration):
        return END
    return exc if exc is not None else read.result()
