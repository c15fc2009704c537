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
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from triptych.router.affinity import AffinityIndex, PrefixIndex
from triptych.router.backend import BackendError, GenerationRequest, TokenEvent
from triptych.router.decode_chain import DecodeChain, finished
from triptych.router.orchestrator_config import (
    ENCODE_ID_SUFFIX,
    Footprint,
    OrchestratorConfig,
    hop_deadline,
    stream_interval,
)
from triptych.router.overhead import record_first_token
from triptych.router.registry import Registry
from triptych.router.relay import Relay, first_tokens
from triptych.router.routing import (
    Chooser,
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
    StageRequest,
    VideoPart,
)
from triptych.topology import Stage

log = logging.getLogger("triptych.router.orchestrator")

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
        self.stages = StageClient(client, self.metrics, channels=self.config.stage_channel)
        self.decoding = DecodeChain(registry, self.chooser, self.stages, self.metrics, self.config)
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
        With no instance for a stage but one mid-switch that runs it before or after, or one
        out of rotation after a failure it may come back from (`Registry.recovering`), wait
        (bounded) on the registry's change event for it to come back and plan again. An
        instance an earlier attempt failed on is tried again when the stage has no other."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.config.plan_wait_s, self.config.stage_timeout_s)
        while True:
            try:
                return self._plan_now(req, excluded)
            except NoInstanceError as exc:
                if excluded and (self.registry.capable(exc.stage) or self.registry.recovering(exc.stage)):
                    # The stage's only instances are those this request failed on: back to
                    # them (once they are ready again) rather than a 503 for want of another.
                    excluded.clear()
                    continue
                held = self.registry.switching(exc.stage, excluded) or self.registry.recovering(exc.stage, excluded)
                if not (held and await self.registry.wait_for_change(deadline - loop.time())):
                    self._decide(exc.stage, "no_instance")
                    raise BackendError(503, str(exc), retry_after=self.config.retry_after_s) from exc

    def _plan_now(self, req: GenerationRequest, excluded: set[str]) -> Plan:
        cfg = self.config
        prefix = (PrefixRouting(self.prefixes, req.prompt_token_ids, req.mm_items, cfg.prefix_weight,
                                cfg.prefix_min_tokens)
                  if cfg.prefix_routing else None)
        plan = plan_request(self.registry, self.chooser, [m.unit for m in req.mm_items], excluded,
                            parallel_encode=cfg.parallel_encode,
                            affinity=self.affinity if cfg.cache_affinity else None, prefix=prefix)
        self.metrics.decided(plan.decisions)
        for content_hash, url in plan.placement:
            self.affinity.remember(content_hash, url)
        if self.videos is not None and any(_is_video(m) for m in req.mm_items):
            plan = replace(plan, decoders=tuple(self.registry.video_decoders(excluded)))
        if prefix is not None:
            prefix.remember(next(hop.instance for hop in plan.hops if Stage.PREFILL in hop.stages))
        return plan

    def _decide(self, stage: Stage, outcome: str) -> None:
        self.decoding.decide(stage, outcome)

    async def _carry_out(self, req: GenerationRequest, plan: Plan, footprint: Footprint
                         ) -> AsyncIterator[TokenEvent]:
        """Run the plan: its encode-only runs (concurrently), then its hops in order, each
        handed what the one before it left (embedding handles to the prefill, the KV handle
        to the decode)."""
        mm_items = [MMItemSpec.of(m) for m in req.mm_items]  # images and videos
        parts = await self._decode_videos(req, plan, mm_items, footprint)
        # By unit: a video taken as frames (LLaVA) goes once, under its own key. A video
        # decoded on V instances goes as parts, not bytes. Raw bytes: they go as the stage
        # frame's binary tail (stage_protocol.encode_stage_request).
        images = {m.unit: data for m, data in zip(req.mm_items, req.images, strict=True) if m.unit not in parts}
        runs = [self._encode_only(req, run, images, _with_parts(mm_items, run.images, parts), footprint)
                for run in plan.encodes]
        # One run is awaited here, not wrapped in a task: a task costs the request two trips
        # through the event loop (start, then wake its waiter) before and after the hop.
        results = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        mm_sources = [source for group in results for source in group]
        kv_source: KVSource | None = None
        for hop in plan.hops:
            if kv_source is not None and list(hop.stages) == [Stage.DECODE]:
                async for event in self.decoding.decode(req, kv_source, mm_items, footprint, first=hop.instance):
                    yield event
                return
            sreq = StageRequest(
                request_id=req.request_id, stages=list(hop.stages), prompt_token_ids=req.prompt_token_ids,
                mm_items=_with_parts(mm_items, hop.images, parts),
                images={h: images[h] for h in hop.images if h in images},
                mm_sources=mm_sources if Stage.PREFILL in hop.stages else [],
                kv_source=kv_source, sampling=req.sampling, grammar=req.grammar,
                timeout_s=hop_deadline(self.config, hop.stages, req), stream_interval=stream_interval(self.config, req),
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
                            takeover = self.decoding.takeover(req, event, mm_items, {hop.instance.url}, footprint, takeover)
                        elif isinstance(event, PrefilledEvent):
                            kv_source = event.kv
                            for token_event in first_tokens(event.kv):
                                yield token_event
                        elif isinstance(event, FinishedEvent):
                            yield finished(hop.instance, event, hop.stages[-1])
                            if relay.finish():
                                return
                        else:
                            for token_event in relay.tokens(event):
                                yield token_event
                if relay.migrated:
                    moving, takeover = takeover, None  # _decode owns it from here
                    async for event in self.decoding.continue_migrated(req, relay.migrated, mm_items, footprint,
                                                               {hop.instance.url}, takeover=moving):
                        yield event
                    return
            finally:
                if takeover is not None:
                    takeover.close()
            if kv_source is None:
                raise StageFailure(hop.instance, f"{hop.instance.url} ended {list(hop.stages)} without a hand-over")

    async def _decode_videos(self, req: GenerationRequest, plan: Plan, mm_items: list[MMItemSpec],
                             footprint: Footprint) -> dict[str, list[VideoPart]]:
        """Decode the request's videos on the plan's V instances, all videos at once, each
        spread over every V instance (router/video_decode.py); the parts by unit (a video
        taken as frames: its key). A video placed on an encode instance whose MM cache holds its embedding (cache
        affinity) is not decoded: it goes as bytes, used only if the entry was evicted."""
        if not plan.decoders or self.videos is None:
            return {}
        videos = {m.unit: (m, data) for m, data in zip(mm_items, req.images, strict=True)
                  if _is_video(m) and m.unit not in plan.cached}  # a video taken as frames: once
        if not videos:
            return {}
        footprint.urls.update(inst.url for inst in plan.decoders)  # an abort frees their leases
        decoded = await asyncio.gather(*(self.videos.decode(req.request_id, data, item, list(plan.decoders))
                                         for item, data in videos.values()))
        return dict(zip(videos, decoded, strict=True))

    async def _encode_only(self, req: GenerationRequest, run: EncodeRun, images: dict[str, bytes],
                           mm_items: list[MMItemSpec], footprint: Footprint) -> list[MMSource]:
        """One encode-only run; the handles of the embeddings it made, for the prefill to pull."""
        items = [m for m in mm_items if m.unit in run.images]
        sreq = StageRequest(request_id=req.request_id + ENCODE_ID_SUFFIX, stages=[Stage.ENCODE],
                            prompt_token_ids=req.prompt_token_ids, mm_items=items,
                            images={h: images[h] for h in run.images if h in images},
                            sampling=req.sampling, timeout_s=self.config.stage_timeout_s)
        footprint.urls.add(run.instance.url)
        async with aclosing(self.stages.run(run.instance, sreq, self.config.stage_timeout_s, footprint.waits)) as events:
            async for event in events:
                if isinstance(event, EncodedEvent):
                    # Fields the event's own validation checked already: not validated again.
                    return [MMSource.model_construct(content_hash=e.content_hash, num_tokens=e.num_tokens,
                                                     handle=e.handle) for e in event.items]
        raise StageFailure(run.instance, f"{run.instance.url} ended the encode stage without a hand-over")


def _with_parts(items: list[MMItemSpec], encoded_here: Sequence[str],
                parts: dict[str, list[VideoPart]]) -> list[MMItemSpec]:
    """The items as one run sees them: a video it encodes carries its V-decoded parts (only
    the encoding instance pulls them; each part's lease is confirmed once)."""
    return [m.model_copy(update={"video_parts": parts[m.unit]})
            if m.unit in parts and m.unit in encoded_here else m for m in items]


def _is_video(item: Any) -> bool:
    """A video item, or a frame of a video taken as images (LLaVA): decoded from a video."""
    return item.kind == "video" or getattr(item, "frame_of", None) is not None or \
        getattr(item, "frame", None) is not None


def _public_failure(status: int) -> str:
    """What a client learns of an instance's failure: the kind, never the worker's URL or its
    response body (those go to the router's log)."""
    what = "timed out" if status == 504 else "failed"
    return f"request failed after streaming began: an instance {what}"
