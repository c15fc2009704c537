"""The decode stage of a request: from a KV another instance offers (a prefill's
hand-over, or a decode migrated mid-stream by a role switch or a drain, EPDServe §3.2.4)
to the last token, across as many decode instances as it moves through. A pre-copy
(router/takeover.py) opens the next hop before the decode stops where it runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace

from triptych.router.backend import BackendError, GenerationRequest, TokenEvent
from triptych.router.orchestrator_config import Footprint, OrchestratorConfig, hop_deadline, stream_interval
from triptych.router.overhead import WaitClock
from triptych.router.overlap import Overlap
from triptych.router.registry import Instance, Registry
from triptych.router.relay import Relay
from triptych.router.routing import Chooser, Decision
from triptych.router.routing_metrics import RoutingMetrics
from triptych.router.stage_client import StageClient, StageFailure
from triptych.router.takeover import Takeover
from triptych.stage_protocol import (
    FinishedEvent,
    KVSource,
    MigratingEvent,
    MMItemSpec,
    PrecopyEvent,
    StageEvent,
    StageRequest,
)
from triptych.topology import Stage

log = logging.getLogger("triptych.router.orchestrator")


def finished(inst: Instance, event: FinishedEvent, stage: Stage) -> TokenEvent:
    """A stage's `finished` event as the client's last one (an abort is never a 200)."""
    if event.finish_reason == "abort":  # the instance dropped it
        raise StageFailure(inst, f"{inst.url} aborted the request", stage=stage)
    return TokenEvent(token_ids=[], finish_reason=event.finish_reason, index=event.index)


class DecodeChain:
    def __init__(self, registry: Registry, chooser: Chooser, stages: StageClient, metrics: RoutingMetrics,
                 config: OrchestratorConfig) -> None:
        self.registry = registry
        self.chooser = chooser
        self.stages = stages
        self.metrics = metrics
        self.config = config

    def decide(self, stage: Stage, outcome: str) -> None:
        self.metrics.decided([Decision(stage, self.chooser.policy_for(stage).value, outcome)])

    def _hop_deadline(self, stages: Sequence[Stage], req: GenerationRequest) -> float:
        return hop_deadline(self.config, stages, req)

    async def continue_migrated(self, req: GenerationRequest, migrated: dict[int, KVSource],
                                 mm_items: list[MMItemSpec], footprint: Footprint, exclude: set[str],
                                 moves: int = 0, takeover: Takeover | None = None) -> AsyncIterator[TokenEvent]:
        """Decodes migrated off an instance go on elsewhere (`_decode`: its bounded wait for a
        decode instance, its hop bound counted from `moves`; through `takeover`, the hop its
        pre-copy opened, if its instance still takes decodes). With n > 1 each choice goes
        on as a request of its own (its own seed stream), one after the other."""
        if req.sampling.n == 1:
            async for event in self.decode(req, migrated[0], mm_items, footprint, exclude=exclude, moves=moves,
                                            takeover=takeover):
                yield event
            return
        if takeover is not None:  # never opened for n > 1; closed all the same
            takeover.close()
        for index, kv in sorted(migrated.items()):
            choice = replace(req, request_id=f"{req.request_id}.c{index}", sampling=req.sampling.for_choice(index))
            async for event in self.decode(choice, kv, mm_items, footprint, exclude=exclude, moves=moves):
                yield replace(event, index=index)

    async def decode(self, req: GenerationRequest, kv: KVSource, mm_items: list[MMItemSpec],
                      footprint: Footprint, first: Instance | None = None,
                      exclude: set[str] | None = None, moves: int = 0,
                      takeover: Takeover | None = None) -> AsyncIterator[TokenEvent]:
        """Decode from a KV cache another instance offers: a prefill's hand-over, or a
        decode migrated mid-stream (EPDServe §3.2.4 role switching, or a drain). A decode
        instance that refuses before its first event (503: switching, draining, full) is
        passed over for another with the same KV; one that migrates the decode on hands a
        new KV, and the stream goes on there. Tokens append to the same client stream."""
        excluded = set(exclude or ())  # instances the decode left: never back there
        refused: set[str] = set()  # 503s: passed over, tried again once nothing else takes it
        target, request_id, attempt = first, req.request_id, 0
        deadline = asyncio.get_running_loop().time() + self.config.decode_wait_s
        taken: Takeover | None = None  # a takeover that took over during a live hand-over's overlap
        try:
            while True:
                attempt += 1
                current: Takeover | None = None  # this hop, when its pre-copy opened it
                if target is None and taken is not None:
                    current, taken = taken, None
                    target, request_id = current.target, current.request_id
                elif target is None:
                    if takeover is not None and self._still_decodes(takeover.target, excluded | refused):
                        current, takeover = takeover, None
                        target, request_id = current.target, current.request_id
                        current.hand_over(kv)  # stop-and-copy: the rest of the KV goes there
                    else:
                        if takeover is not None:
                            takeover.close()
                            takeover = None
                        target = await self._decode_target(excluded, refused, deadline)
                        request_id = f"{req.request_id}.d{attempt}"  # the old instance may still hold the old id
                        footprint.ids.append(request_id)
                footprint.urls.add(target.url)
                received = False
                relay = Relay(req.sampling.n)
                try:
                    async with aclosing(current.events() if current is not None else
                                        self._decode_hop(target, request_id, req, kv, mm_items, footprint)) as events:
                        async for event in events:
                            received = True
                            if isinstance(event, PrecopyEvent):
                                takeover = self.takeover(req, event, mm_items, excluded | {target.url}, footprint,
                                                          takeover)
                            elif isinstance(event, MigratingEvent) and event.live and takeover is not None \
                                    and self._still_decodes(takeover.target, excluded | refused | {target.url}):
                                # Make-before-break (router/overlap.py): the source goes on while
                                # the target pulls and follows; the stream waits for the cut alone.
                                takeover.hand_over(event.kv, live=True)
                                overlap = Overlap(target, takeover, event.kv)
                                async for token_event in overlap.run(events):
                                    yield token_event
                                if overlap.finished is not None:
                                    assert overlap.finished_by is not None
                                    yield finished(overlap.finished_by, overlap.finished, Stage.DECODE)
                                    return
                                taken, takeover = takeover, None
                                self.decide(Stage.DECODE, "overlapped")
                                # Closing its stream stops the source once its instance sees the
                                # connection end; the abort stops it at its next step.
                                self.stages.abort_later([target.url], [request_id], self.config.abort_timeout_s)
                                relay.tokens(event)
                                break  # the source is closed: it stops there
                            elif isinstance(event, FinishedEvent):
                                yield finished(target, event, Stage.DECODE)
                                if relay.finish():
                                    return
                            else:
                                for token_event in relay.tokens(event):
                                    yield token_event
                                if relay.handed_on():
                                    break  # the next hop need not wait for this stream's end
                except StageFailure as failure:
                    if received or failure.status != 503:
                        raise
                    log.info("request %s: %s refused the decode (%s); trying another", req.request_id,
                             target.url, failure)
                    self.decide(Stage.DECODE, "retried")
                    refused.add(target.url)
                else:
                    if not relay.migrated:
                        raise StageFailure(target, f"{target.url} ended the decode without finishing it",
                                           stage=Stage.DECODE)
                    moves += 1
                    if moves > self.config.max_decode_hops:
                        raise StageFailure(target, f"decode moved more than {self.config.max_decode_hops} times",
                                           stage=Stage.DECODE)
                    excluded.add(target.url)
                    log.info("request %s: decode migrated off %s", req.request_id, target.url)
                    if req.sampling.n > 1:  # each migrated choice goes on by itself
                        async for event in self.continue_migrated(req, relay.migrated, mm_items, footprint,
                                                                   excluded, moves):
                            yield event
                        return
                    kv = relay.migrated[0]
                    deadline = asyncio.get_running_loop().time() + self.config.decode_wait_s
                finally:
                    if current is not None:
                        current.close()  # done, or its reader left: the connection goes
                target = None
        finally:
            for unused in (takeover, taken):  # opened by a pre-copy, never (or not yet) read from
                if unused is not None:
                    unused.close()

    def _decode_hop(self, target: Instance, request_id: str, req: GenerationRequest, kv: KVSource,
                    mm_items: list[MMItemSpec], footprint: Footprint) -> AsyncIterator[StageEvent]:
        sreq = StageRequest(request_id=request_id, stages=[Stage.DECODE], prompt_token_ids=req.prompt_token_ids,
                            mm_items=mm_items, kv_source=kv, sampling=req.sampling, grammar=req.grammar,
                            timeout_s=self._hop_deadline([Stage.DECODE], req),
                            stream_interval=stream_interval(self.config, req))
        return self.stages.run(target, sreq, self.config.stage_timeout_s, footprint.waits)

    def takeover(self, req: GenerationRequest, event: PrecopyEvent, mm_items: list[MMItemSpec],
                  exclude: set[str], footprint: Footprint, previous: Takeover | None) -> Takeover | None:
        """A decode is about to move (its instance switches role or drains): open its next hop
        at another decode instance now, with its full blocks to pre-copy (router/takeover.py).
        None for n > 1 (its choices move without one) or with no other decode instance."""
        if previous is not None:
            previous.close()
        candidates = self.registry.capable(Stage.DECODE, exclude)
        if req.sampling.n > 1 or not candidates:
            return None
        target = self.chooser.choose(Stage.DECODE, candidates)
        request_id = f"{req.request_id}.t{len(footprint.ids)}"  # unique among the request's ids
        footprint.ids.append(request_id)
        footprint.urls.add(target.url)
        sreq = StageRequest(request_id=request_id, stages=[Stage.DECODE], prompt_token_ids=req.prompt_token_ids,
                            mm_items=mm_items, kv_source=event.kv, sampling=req.sampling, grammar=req.grammar,
                            timeout_s=self._hop_deadline([Stage.DECODE], req),
                            stream_interval=stream_interval(self.config, req))
        # Its own wait clock: it runs beside the source's hop until the hand-over.
        return Takeover(self.stages, target, sreq, self.config.stage_timeout_s, WaitClock())

    def _still_decodes(self, inst: Instance, excluded: set[str]) -> bool:
        return any(i.url == inst.url for i in self.registry.capable(Stage.DECODE, excluded))

    async def _decode_target(self, excluded: set[str], refused: set[str], deadline: float) -> Instance:
        """A decode instance for a KV in hand: one that has not refused it, else (after a
        pause) one that refused it before — a switch or a full queue passes. Until
        `deadline`, waiting is safe: the KV's source holds it under its lease."""
        loop, pause = asyncio.get_running_loop(), 0.02
        while True:
            candidates = self.registry.capable(Stage.DECODE, excluded | refused)
            if candidates:
                return self.chooser.choose(Stage.DECODE, candidates)
            if loop.time() + pause > deadline:
                self.decide(Stage.DECODE, "no_instance")
                raise BackendError(503, "no decode instance to continue the request on",
                                   retry_after=self.config.retry_after_s)
            await self.registry.wait_for_change(pause)  # an instance back in rotation ends it early
            pause = min(pause * 2, 0.5)
            refused.clear()
