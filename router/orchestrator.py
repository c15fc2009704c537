"""Moves each request through its stages across instances and streams tokens back.

For every request: plan its path (routing.plan_request: the hops, and where each image is
encoded), carry the plan out over the workers' `/internal/run` NDJSON streams
(stage_client.py) — encode-only runs first, concurrently, then the hops in order — carry
the hand-over handles between them (the control messages of HydraInfer §4.3's pull-based
migration; the data moves worker-to-worker over NIXL), and yield tokens as they arrive.
A failure before the first token is retried on other instances under a fresh id; after
it, the request ends with an error. Every call has a deadline, and an abandoned request
is aborted on every instance it touched, under every id it used there.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client import CollectorRegistry

from triptych.router.affinity import AffinityIndex, PrefixIndex
from triptych.router.backend import BackendError, GenerationRequest, TokenEvent
from triptych.router.overhead import WaitClock, record_first_token
from triptych.router.registry import Instance, Registry
from triptych.router.relay import Relay, first_tokens
from triptych.router.routing import (
    Chooser,
    Decision,
    EncodeRun,
    NoInstanceError,
    Plan,
    PrefixRouting,
    plan_request,
    stages_for,
)
from triptych.router.routing_metrics import RoutingMetrics
from triptych.router.stage_client import StageClient, StageFailure
from triptych.router.takeover import Takeover
from triptych.router.video_decode import VideoDispatcher
from triptych.stage_protocol import (
    EncodedEvent,
    FinishedEvent,
    KVSource,
    MMItemSpec,
    MMSource,
    PrecopyEvent,
    PrefilledEvent,
    StageEvent,
    StageRequest,
    VideoPart,
)
from triptych.topology import Stage

log = logging.getLogger("triptych.router.orchestrator")

# Encode-only runs go by their own id on the worker: the same instance may run a later hop
# of the request (an ED instance decodes what it encoded) while the encode run is still
# parked until its lease is released, and a worker's engine keys requests by id.
ENCODE_ID_SUFFIX = ".encode"

@dataclass
class OrchestratorConfig:
    stage_timeout_s: float = 60.0  # longest silence allowed on a stage stream
    max_attempts: int = 3  # tries of the pre-first-token part of a request
    parallel_encode: bool = True  # EPDServe §3.2.2 intra-request parallelism
    cache_affinity: bool = True  # send an image to the instance whose MM cache holds it
    affinity_entries: int = 4096  # image hashes remembered (an LRU; a stale entry only costs an encode)
    prefix_routing: bool = True  # prefill where the prompt's prefix is likely cached (routing.PrefixRouting)
    prefix_weight: float = 8.0  # queued requests a whole-prompt cache hit is worth
    prefix_min_tokens: int = 64  # shorter hits (a chat template's header) leave the choice to the policy
    prefix_entries: int = 1 << 18  # prompt block hashes remembered (an LRU; a stale one costs a prefill)
    abort_timeout_s: float = 2.0
    per_token_timeout_s: float = 1.0  # a decode hop's deadline grows with max_tokens
    max_inflight: int = 512  # requests in flight before new ones get 429
    max_instance_load: float | None = None  # 429 when every first-stage instance reports more queued work
    retry_after_s: float = 1.0
    max_decode_hops: int = 8  # times one decode may migrate to another instance
    # With a KV in hand (its source holds it under a lease) and no decode instance taking
    # it — all switching, refusing, or unseen by the registry for a moment — wait this
    # long for one before failing the request.
    decode_wait_s: float = 10.0
    # A request planned while every instance of a stage it needs is mid-switch (the only P
    # or D changing role) waits this long — never past stage_timeout_s — for one to come
    # back, instead of a 503; with none switching, the 503 is at once.
    plan_wait_s: float = 10.0


@dataclass
class Footprint:
    """Where a request has been: every instance a call went to, and the request's id of
    each attempt (an encode-only run used that id + ENCODE_ID_SUFFIX). Aborts go to all."""

    urls: set[str] = field(default_factory=set)
    ids: list[str] = field(default_factory=list)
    waits: WaitClock = field(default_factory=WaitClock)  # time spent waiting on workers (overhead.py)

    def abort_ids(self) -> list[str]:
        return [i + suffix for i in self.ids for suffix in ("", ENCODE_ID_SUFFIX)]


class Orchestrator:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, chooser: Chooser | None = None,
                 config: OrchestratorConfig | None = None,
                 metrics_registry: CollectorRegistry | None = None,
                 videos: VideoDispatcher | None = None) -> None:
        self.registry = registry
        self.videos = videos  # None: no V-instance decoding (the encoding instance decodes)
        self.client = client
        self.chooser = chooser or Chooser()
        self.config = config or OrchestratorConfig()
        self.affinity = AffinityIndex(self.config.affinity_entries)
        self.prefixes = PrefixIndex(self.config.prefix_entries)
        self.metrics = RoutingMetrics(metrics_registry, registry)
        self.stages = StageClient(client, self.metrics)
        self.inflight = 0

    # -- Backend protocol -------------------------------------------------------------
    def ready(self) -> bool:
        return bool(self.registry.capable(Stage.PREFILL)) and bool(self.registry.capable(Stage.DECODE))

    async def health(self) -> dict:
        roles = self.registry.roles_summary()
        stages = {s.value: len(self.registry.capable(s)) for s in Stage}
        stages["video_decode"] = len(self.registry.video_decoders())
        if not self.ready():
            status = "unavailable"
        elif all(v["ready"] == v["total"] for v in roles.values()) and stages["encode"]:
            status = "ok"
        else:
            status = "degraded"
        instances = [{"url": i.url, "role": i.role.value if i.role else "unassigned", "ready": i.ready,
                      "draining": i.draining, "load": i.load, "instance_id": i.instance_id,
                      "switching_to": i.switching_to, "video": i.video}
                     for i in self.registry.instances.values()]
        return {"status": status, "roles": roles, "stages": stages, "instances": instances,
                "inflight": self.inflight}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self._admit(req)
        footprint = Footprint()
        self.inflight += 1
        first = True
        try:
            async for event in self._generate(req, footprint):
                if first and event.token_ids:
                    record_first_token(footprint.waits)
                    first = False
                yield event
        except (asyncio.CancelledError, GeneratorExit, BackendError):
            await self.stages.abort(footprint.urls, footprint.abort_ids(), self.config.abort_timeout_s)
            raise
        finally:
            self.inflight -= 1

    def _admit(self, req: GenerationRequest) -> None:
        """Overload control: refuse with 429 + Retry-After instead of queueing without bound."""
        cfg = self.config
        first = stages_for(bool(req.mm_items))[0]
        if self.inflight >= cfg.max_inflight:
            self._decide(first, "overloaded")
            raise BackendError(429, f"server busy: {self.inflight} requests in flight (limit {cfg.max_inflight})",
                               retry_after=cfg.retry_after_s)
        capable = self.registry.capable(first)
        if cfg.max_instance_load is not None and capable and all(
                i.load + i.inflight > cfg.max_instance_load for i in capable):
            self._decide(first, "overloaded")
            raise BackendError(429, f"server busy: every {first.value} instance has more than "
                                    f"{cfg.max_instance_load:g} queued", retry_after=cfg.retry_after_s)

    # -- the request path -------------------------------------------------------------
    async def _generate(self, req: GenerationRequest, footprint: Footprint) -> AsyncIterator[TokenEvent]:
        excluded: set[str] = set()
        last_error = "no attempt made"
        base_id = req.request_id
        for attempt in range(self.config.max_attempts):
            # A retry runs under its own id: an instance the failed attempt reached may still
            # hold the old one (a hand-off parked until its lease is confirmed or expires),
            # and its engine refuses a second request under an id in use.
            req = replace(req, request_id=base_id if attempt == 0 else f"{base_id}.retry{attempt}")
            footprint.ids.append(req.request_id)
            plan = await self._plan(req, excluded)
            started = False
            try:
                async for event in self._carry_out(req, plan, footprint):
                    started = True
                    yield event
                return
            except StageFailure as failure:
                self.registry.mark_failed(failure.instance.url)
                self.prefixes.forget(failure.instance.url)  # it may come back empty (a restart)
                excluded.add(failure.instance.url)
                last_error = str(failure)
                if started:
                    log.warning("request %s failed after streaming began: %s", req.request_id, failure)
                    raise BackendError(failure.status, _public_failure(failure.status)) from failure
                self._decide(failure.stage or Stage.PREFILL, "retried")
                log.warning("request %s: %s; retrying elsewhere", req.request_id, failure)
                # What the attempt left parked under leases (an encode, a prefill) is freed
                # now, not at the leases' expiry.
                self.stages.abort_later(footprint.urls, [req.request_id, req.request_id + ENCODE_ID_SUFFIX],
                                        self.config.abort_timeout_s)
        log.warning("request %s failed on every attempt; last: %s", base_id, last_error)
        raise BackendError(503, f"request failed on every attempt ({self.config.max_attempts}); try again later",
                           retry_after=self.config.retry_after_s)

    async def _plan(self, req: GenerationRequest, excluded: set[str]) -> Plan:
        """The attempt's plan; its decisions are counted and its image placement remembered.
        With no instance for a stage but one mid-switch that runs it before or after, wait
        (bounded) on the registry's change event for it to come back and plan again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.config.plan_wait_s, self.config.stage_timeout_s)
        while True:
            try:
                return self._plan_now(req, excluded)
            except NoInstanceError as exc:
                if not (self.registry.switching(exc.stage, excluded)
                        and await self.registry.wait_for_change(deadline - loop.time())):
                    self._decide(exc.stage, "no_instance")
                    raise BackendError(503, str(exc), retry_after=self.config.retry_after_s) from exc

    def _plan_now(self, req: GenerationRequest, excluded: set[str]) -> Plan:
        cfg = self.config
        prefix = (PrefixRouting(self.prefixes, req.prompt_token_ids, req.mm_items, cfg.prefix_weight,
                                cfg.prefix_min_tokens)
                  if cfg.prefix_routing else None)
        plan = plan_request(self.registry, self.chooser, [m.content_hash for m in req.mm_items], excluded,
                            parallel_encode=cfg.parallel_encode,
                            affinity=self.affinity if cfg.cache_affinity else None, prefix=prefix)
        self.metrics.decided(plan.decisions)
        for content_hash, url in plan.placement:
            self.affinity.remember(content_hash, url)
        if self.videos is not None and any(m.kind == "video" for m in req.mm_items):
            plan = replace(plan, decoders=tuple(self.registry.video_decoders(excluded)))
        if prefix is not None:
            prefix.remember(next(hop.instance for hop in plan.hops if Stage.PREFILL in hop.stages))
        return plan

    def _deadline(self, stages: Sequence[Stage], req: GenerationRequest) -> float:
        """The worker-side deadline of one hop: a stage's budget, plus time per token to
        decode (silence is caught sooner, by the stream's read timeout)."""
        budget = self.config.stage_timeout_s
        if Stage.DECODE in stages:
            budget += req.sampling.max_tokens * self.config.per_token_timeout_s
        return budget

    def _decide(self, stage: Stage, outcome: str) -> None:
        self.metrics.decided([Decision(stage, self.chooser.policy_for(stage).value, outcome)])

    async def _carry_out(self, req: GenerationRequest, plan: Plan, footprint: Footprint
                         ) -> AsyncIterator[TokenEvent]:
        """Run the plan: its encode-only runs (concurrently), then its hops in order, each
        handed what the one before it left (embedding handles to the prefill, the KV handle
        to the decode)."""
        mm_items = [MMItemSpec.of(m) for m in req.mm_items]  # images and videos
        parts = await self._decode_videos(req, plan, mm_items, footprint)
        images = {m.content_hash: base64.b64encode(data).decode() for m, data in zip(req.mm_items, req.images,
                                                                                     strict=True)
                  if m.content_hash not in parts}  # a video decoded on V instances goes as parts, not bytes
        results = await asyncio.gather(*(self._encode_only(req, run, images, _with_parts(mm_items, run.images, parts),
                                                           footprint)
                                         for run in plan.encodes))
        mm_sources = [source for group in results for source in group]
        kv_source: KVSource | None = None
        for hop in plan.hops:
            if kv_source is not None and list(hop.stages) == [Stage.DECODE]:
                async for event in self._decode(req, kv_source, mm_items, footprint, first=hop.instance):
                    yield event
                return
            sreq = StageRequest(
                request_id=req.request_id, stages=list(hop.stages), prompt_token_ids=req.prompt_token_ids,
                mm_items=_with_parts(mm_items, hop.images, parts),
                images={h: images[h] for h in hop.images if h in images},
                mm_sources=mm_sources if Stage.PREFILL in hop.stages else [],
                kv_source=kv_source, sampling=req.sampling, grammar=req.grammar,
                timeout_s=self._deadline(hop.stages, req),
            )
            footprint.urls.add(hop.instance.url)
            kv_source = None
            relay = Relay(req.sampling.n)
            takeover: Takeover | None = None  # the decode's next hop, if it is to move (a pre-copy)
            try:
                async with aclosing(self.stages.run(hop.instance, sreq, self.config.stage_timeout_s,
                                                    footprint.waits)) as events:
                    async for event in events:
                        if isinstance(event, PrecopyEvent):
                            takeover = self._takeover(req, event, mm_items, {hop.instance.url}, footprint, takeover)
                        elif isinstance(event, PrefilledEvent):
                            kv_source = event.kv
                            for token_event in first_tokens(event.kv):
                                yield token_event
                        elif isinstance(event, FinishedEvent):
                            yield self._finished(hop.instance, event, hop.stages[-1])
                            if relay.finish():
                                return
                        else:
                            for token_event in relay.tokens(event):
                                yield token_event
                if relay.migrated:
                    moving, takeover = takeover, None  # _decode owns it from here
                    async for event in self._continue_migrated(req, relay.migrated, mm_items, footprint,
                                                               {hop.instance.url}, takeover=moving):
                        yield event
                    return
            finally:
                if takeover is not None:
                    takeover.close()
            if kv_source is None:
                raise StageFailure(hop.instance, f"{hop.instance.url} ended {list(hop.stages)} without a hand-over")

    async def _continue_migrated(self, req: GenerationRequest, migrated: dict[int, KVSource],
                                 mm_items: list[MMItemSpec], footprint: Footprint, exclude: set[str],
                                 moves: int = 0, takeover: Takeover | None = None) -> AsyncIterator[TokenEvent]:
        """Decodes migrated off an instance go on elsewhere (`_decode`: its bounded wait for a
        decode instance, its hop bound counted from `moves`; through `takeover`, the hop its
        pre-copy opened, if its instance still takes decodes). With n > 1 each choice goes
        on as a request of its own (its own seed stream), one after the other."""
        if req.sampling.n == 1:
            async for event in self._decode(req, migrated[0], mm_items, footprint, exclude=exclude, moves=moves,
                                            takeover=takeover):
                yield event
            return
        if takeover is not None:  # never opened for n > 1; closed all the same
            takeover.close()
        for index, kv in sorted(migrated.items()):
            choice = replace(req, request_id=f"{req.request_id}.c{index}", sampling=req.sampling.for_choice(index))
            async for event in self._decode(choice, kv, mm_items, footprint, exclude=exclude, moves=moves):
                yield replace(event, index=index)

    async def _decode_videos(self, req: GenerationRequest, plan: Plan, mm_items: list[MMItemSpec],
                             footprint: Footprint) -> dict[str, list[VideoPart]]:
        """Decode the request's videos on the plan's V instances, all videos at once, each
        spread over every V instance (router/video_decode.py); the parts by content hash. A
        video placed on an encode instance whose MM cache holds its embedding (cache
        affinity) is not decoded: it goes as bytes, used only if the entry was evicted."""
        if not plan.decoders or self.videos is None:
            return {}
        videos = {m.content_hash: (m, data) for m, data in zip(mm_items, req.images, strict=True)
                  if m.kind == "video" and m.content_hash not in plan.cached}
        if not videos:
            return {}
        footprint.urls.update(inst.url for inst in plan.decoders)  # an abort frees their leases
        decoded = await asyncio.gather(*(self.videos.decode(req.request_id, data, item, list(plan.decoders))
                                         for item, data in videos.values()))
        return dict(zip(videos, decoded, strict=True))

    @staticmethod
    def _finished(inst: Instance, event: FinishedEvent, stage: Stage) -> TokenEvent:
        if event.finish_reason == "abort":  # the instance dropped it: never a 200
            raise StageFailure(inst, f"{inst.url} aborted the request", stage=stage)
        return TokenEvent(token_ids=[], finish_reason=event.finish_reason, index=event.index)

    async def _decode(self, req: GenerationRequest, kv: KVSource, mm_items: list[MMItemSpec],
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
        try:
            while True:
                attempt += 1
                current: Takeover | None = None  # this hop, when its pre-copy opened it
                if target is None:
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
                                takeover = self._takeover(req, event, mm_items, excluded | {target.url}, footprint,
                                                          takeover)
                            elif isinstance(event, FinishedEvent):
                                yield self._finished(target, event, Stage.DECODE)
                                if relay.finish():
                                    return
                            else:
                                for token_event in relay.tokens(event):
                                    yield token_event
                except StageFailure as failure:
                    if received or failure.status != 503:
                        raise
                    log.info("request %s: %s refused the decode (%s); trying another", req.request_id,
                             target.url, failure)
                    self._decide(Stage.DECODE, "retried")
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
                        async for event in self._continue_migrated(req, relay.migrated, mm_items, footprint,
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
            if takeover is not None:  # opened by a pre-copy, never handed over
                takeover.close()

    def _decode_hop(self, target: Instance, request_id: str, req: GenerationRequest, kv: KVSource,
                    mm_items: list[MMItemSpec], footprint: Footprint) -> AsyncIterator[StageEvent]:
        sreq = StageRequest(request_id=request_id, stages=[Stage.DECODE], prompt_token_ids=req.prompt_token_ids,
                            mm_items=mm_items, kv_source=kv, sampling=req.sampling, grammar=req.grammar,
                            timeout_s=self._deadline([Stage.DECODE], req))
        return self.stages.run(target, sreq, self.config.stage_timeout_s, footprint.waits)

    def _takeover(self, req: GenerationRequest, event: PrecopyEvent, mm_items: list[MMItemSpec],
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
                            timeout_s=self._deadline([Stage.DECODE], req))
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
                self._decide(Stage.DECODE, "no_instance")
                raise BackendError(503, "no decode instance to continue the request on",
                                   retry_after=self.config.retry_after_s)
            await self.registry.wait_for_change(pause)  # an instance back in rotation ends it early
            pause = min(pause * 2, 0.5)
            refused.clear()

    async def _encode_only(self, req: GenerationRequest, run: EncodeRun, images: dict[str, str],
                           mm_items: list[MMItemSpec], footprint: Footprint) -> list[MMSource]:
        """One encode-only run; the handles of the embeddings it made, for the prefill to pull."""
        items = [m for m in mm_items if m.content_hash in run.images]
        sreq = StageRequest(request_id=req.request_id + ENCODE_ID_SUFFIX, stages=[Stage.ENCODE],
                            prompt_token_ids=req.prompt_token_ids, mm_items=items,
                            images={h: images[h] for h in run.images if h in images},
                            sampling=req.sampling, timeout_s=self.config.stage_timeout_s)
        footprint.urls.add(run.instance.url)
        async with aclosing(self.stages.run(run.instance, sreq, self.config.stage_timeout_s, footprint.waits)) as events:
            async for event in events:
                if isinstance(event, EncodedEvent):
                    return [MMSource(content_hash=e.content_hash, num_tokens=e.num_tokens, handle=e.handle)
                            for e in event.items]
        raise StageFailure(run.instance, f"{run.instance.url} ended the encode stage without a hand-over")


def _with_parts(items: list[MMItemSpec], encoded_here: Sequence[str],
                parts: dict[str, list[VideoPart]]) -> list[MMItemSpec]:
    """The items as one run sees them: a video it encodes carries its V-decoded parts (only
    the encoding instance pulls them; each part's lease is confirmed once)."""
    return [m.model_copy(update={"video_parts": parts[m.content_hash]})
            if m.content_hash in parts and m.content_hash in encoded_here else m for m in items]


def _public_failure(status: int) -> str:
    """What a client learns of an instance's failure: the kind, never the worker's URL or its
    response body (those go to the router's log)."""
    what = "timed out" if status == 504 else "failed"
    return f"request failed after streaming began: an instance {what}"
