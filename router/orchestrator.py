"""Moves each request through its stages across instances and streams tokens back.

For every request: plan the hops (routing.py), run them in order over the workers'
`/internal/run` NDJSON streams, carry the hand-over handles between them (the control
messages of HydraInfer §4.3's pull-based migration; the data moves worker-to-worker over
NIXL), and yield tokens as they arrive. A failure before the first token is retried on
other instances; after it, the request ends with an error. Every call has a deadline,
and an abandoned request is aborted on every instance it touched.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from triptych.router.backend import BackendError, GenerationRequest, TokenEvent
from triptych.router.registry import Instance, Registry
from triptych.router.routing import Chooser, Hop, NoInstanceError, plan_path, spread_images, stages_for
from triptych.stage_protocol import (
    EncodedEvent,
    ErrorEvent,
    FinishedEvent,
    KVSource,
    MMItemSpec,
    MMSource,
    PrefilledEvent,
    StageRequest,
    TokensEvent,
)
from triptych.topology import Stage

log = logging.getLogger("triptych.router.orchestrator")

# Encode-only runs go by their own id on the worker: the same instance may run a later hop
# of the request (an ED instance decodes what it encoded) while the encode run is still
# parked until its lease is released, and a worker's engine keys requests by id.
ENCODE_ID_SUFFIX = ".encode"

_EVENT_TYPES = {cls.model_fields["type"].default: cls
                for cls in (EncodedEvent, TokensEvent, PrefilledEvent, FinishedEvent, ErrorEvent)}


class StageFailure(Exception):
    """A hop failed. `retriable` when nothing reached the client yet and another try may work."""

    def __init__(self, instance: Instance, message: str, status: int = 502, stage: Stage | None = None) -> None:
        super().__init__(message)
        self.instance = instance
        self.status = status
        self.stage = stage


@dataclass
class OrchestratorConfig:
    stage_timeout_s: float = 60.0  # longest silence allowed on a stage stream
    max_attempts: int = 3  # tries of the pre-first-token part of a request
    parallel_encode: bool = True  # EPDServe §3.2.2 intra-request parallelism
    cache_affinity: bool = True  # send an image to the instance whose MM cache holds it
    affinity_entries: int = 4096  # image hashes remembered (an LRU; a stale entry only costs an encode)
    abort_timeout_s: float = 2.0
    per_token_timeout_s: float = 1.0  # a decode hop's deadline grows with max_tokens
    max_inflight: int = 512  # requests in flight before new ones get 429
    max_instance_load: float | None = None  # 429 when every first-stage instance reports more queued work
    retry_after_s: float = 1.0


class RoutingMetrics:
    """`triptych_frontend_routing_decisions_total{stage, policy, outcome}` and per-instance gauges."""

    def __init__(self, registry: CollectorRegistry | None, registry_view: Registry) -> None:
        self.decisions = Counter("triptych_frontend_routing_decisions",
                                 "Instance choices per stage: chosen by policy, kept local, by cache "
                                 "affinity, retried elsewhere, or refused (no instance, overloaded)",
                                 ["stage", "policy", "outcome"], registry=registry)
        self.hop_seconds = Histogram("triptych_frontend_hop_seconds",
                                     "Wall time of one stage call (a hop) seen from the router",
                                     ["stages", "outcome"], registry=registry,
                                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        view = registry_view

        class _Instances(Collector):
            def collect(self):  # type: ignore[no-untyped-def]
                load = GaugeMetricFamily("triptych_frontend_instance_load",
                                         "Queued work each instance reported at its last health probe",
                                         labels=["instance", "role"])
                ready = GaugeMetricFamily("triptych_frontend_instance_ready", "1 when routable",
                                          labels=["instance", "role"])
                for inst in view.instances.values():
                    labels = [inst.url, inst.role.value if inst.role else "unassigned"]
                    load.add_metric(labels, inst.load)
                    ready.add_metric(labels, float(inst.ready and not inst.draining))
                yield load
                yield ready

        if registry is not None:
            registry.register(_Instances())


@dataclass
class RequestTrace:
    """What happened to one request, for metrics and tests."""

    hops: list[tuple[str, list[str]]] = field(default_factory=list)
    attempts: int = 0
    migrations: dict[str, float] = field(default_factory=dict)


class Orchestrator:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, chooser: Chooser | None = None,
                 config: OrchestratorConfig | None = None,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.registry = registry
        self.client = client
        self.chooser = chooser or Chooser()
        self.config = config or OrchestratorConfig()
        self.affinity = AffinityIndex(self.config.affinity_entries)
        self.metrics = RoutingMetrics(metrics_registry, registry)
        self.inflight = 0

    # -- Backend protocol -------------------------------------------------------------
    def ready(self) -> bool:
        return bool(self.registry.capable(Stage.PREFILL)) and bool(self.registry.capable(Stage.DECODE))

    async def health(self) -> dict:
        roles = self.registry.roles_summary()
        stages = {s.value: len(self.registry.capable(s)) for s in Stage}
        if not self.ready():
            status = "unavailable"
        elif all(v["ready"] == v["total"] for v in roles.values()) and stages["encode"]:
            status = "ok"
        else:
            status = "degraded"
        instances = [{"url": i.url, "role": i.role.value if i.role else "unassigned", "ready": i.ready,
                      "draining": i.draining, "load": i.load, "instance_id": i.instance_id}
                     for i in self.registry.instances.values()]
        return {"status": status, "roles": roles, "stages": stages, "instances": instances,
                "inflight": self.inflight}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self._admit(req)
        touched: set[str] = set()
        ids: list[str] = []  # the request's id on the workers, one per attempt
        self.inflight += 1
        try:
            async for event in self._generate(req, touched, ids):
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            await self._abort(ids, touched)
            raise
        except BackendError:
            await self._abort(ids, touched)
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
    async def _generate(self, req: GenerationRequest, touched: set[str], ids: list[str]
                        ) -> AsyncIterator[TokenEvent]:
        excluded: set[str] = set()
        stages = stages_for(bool(req.mm_items))
        last_error = "no attempt made"
        base_id = req.request_id
        for attempt in range(self.config.max_attempts):
            # A retry runs under its own id: an instance the failed attempt reached may still
            # hold the old one (a hand-off parked until its lease is confirmed or expires),
            # and its engine refuses a second request under an id in use.
            req = replace(req, request_id=base_id if attempt == 0 else f"{base_id}.retry{attempt}")
            ids.append(req.request_id)
            try:
                hops = plan_path(self.registry, self.chooser, stages, excluded)
            except NoInstanceError as exc:
                self._decide(exc.stage, "no_instance")
                raise BackendError(503, str(exc), retry_after=self.config.retry_after_s) from exc
            self._count_hops(hops)
            started = False
            try:
                async for event in self._run_hops(req, hops, touched, excluded):
                    started = True
                    yield event
                return
            except StageFailure as failure:
                self.registry.mark_failed(failure.instance.url)
                excluded.add(failure.instance.url)
                last_error = str(failure)
                if started:
                    raise BackendError(failure.status, f"request failed after streaming began: {failure}") \
                        from failure
                self._decide(failure.stage or Stage.PREFILL, "retried")
                log.warning("request %s: %s; retrying elsewhere", req.request_id, failure)
        raise BackendError(503, f"request failed on every attempt: {last_error}",
                           retry_after=self.config.retry_after_s)

    def _deadline(self, stages: list[Stage], req: GenerationRequest) -> float:
        """The worker-side deadline of one hop: a stage's budget, plus time per token to
        decode (silence is caught sooner, by the stream's read timeout)."""
        budget = self.config.stage_timeout_s
        if Stage.DECODE in stages:
            budget += req.sampling.max_tokens * self.config.per_token_timeout_s
        return budget

    def _count_hops(self, hops: list[Hop]) -> None:
        for hop in hops:
            first, *rest = hop.stages
            self._decide(first, "chosen")
            for stage in rest:
                self._decide(stage, "kept_local")

    def _decide(self, stage: Stage, outcome: str) -> None:
        self.metrics.decisions.labels(stage.value, self.chooser.policy_for(stage).value, outcome).inc()

    async def _run_hops(self, req: GenerationRequest, hops: list[Hop], touched: set[str],
                        excluded: set[str]) -> AsyncIterator[TokenEvent]:
        mm_items = [MMItemSpec(kind="image", offset=m.offset, length=m.length, content_hash=m.content_hash,
                               grid_thw=m.grid_thw) for m in req.mm_items]
        images = {m.content_hash: base64.b64encode(data).decode() for m, data in zip(req.mm_items, req.images,
                                                                                     strict=True)}
        mm_sources: list[MMSource] = []
        if hops[0].stages[0] is Stage.ENCODE:
            hops, images, mm_sources = await self._encode_spread(req, hops, images, mm_items, touched, excluded)
        kv_source: KVSource | None = None
        for hop in hops:
            sreq = StageRequest(
                request_id=req.request_id, stages=hop.stages, prompt_token_ids=req.prompt_token_ids,
                mm_items=mm_items, images=images if Stage.ENCODE in hop.stages else {},
                mm_sources=mm_sources if Stage.PREFILL in hop.stages else [],
                kv_source=kv_source, sampling=req.sampling, timeout_s=self._deadline(hop.stages, req),
            )
            touched.add(hop.instance.url)
            kv_source = None
            async for event in self._stream(hop.instance, sreq):
                if isinstance(event, PrefilledEvent):
                    kv_source = event.kv
                    yield TokenEvent(token_ids=[event.kv.first_token])
                elif isinstance(event, TokensEvent):
                    yield TokenEvent(token_ids=event.token_ids)
                elif isinstance(event, FinishedEvent):
                    if event.finish_reason == "abort":  # the instance dropped it: never a 200
                        raise StageFailure(hop.instance, f"{hop.instance.url} aborted the request",
                                           stage=hop.stages[-1])
                    yield TokenEvent(token_ids=[], finish_reason=event.finish_reason)
                    return
            if kv_source is None:
                raise StageFailure(hop.instance, f"{hop.instance.url} ended {hop.stages} without a hand-over")

    async def _encode_spread(self, req: GenerationRequest, hops: list[Hop], images: dict[str, str],
                             mm_items: list[MMItemSpec], touched: set[str], excluded: set[str]
                             ) -> tuple[list[Hop], dict[str, str], list[MMSource]]:
        """Run encode-only work first: on E-only hops, and (IRP) images spread to other instances.

        Returns the remaining hops, the images the first remaining hop still encodes itself,
        and the embeddings to pull from elsewhere."""
        first = hops[0]
        # Images picked for the instance that will prefill the request are encoded in its own
        # hop: an encode-only run there would hand embeddings to itself under the same id.
        prefill = next(h for h in hops if Stage.PREFILL in h.stages)
        hashes = list(dict.fromkeys(m.content_hash for m in mm_items))
        if self.config.parallel_encode and len(hashes) > 1:
            picks = spread_images(self.registry, self.chooser, len(hashes), first.instance, excluded)
        else:
            picks = [first.instance] * len(hashes)
        if self.config.cache_affinity:
            held = [self.affinity.holder(h, self.registry, excluded) for h in hashes]
            for holder in held:
                if holder is not None:
                    self.metrics.decisions.labels("encode", "cache-affinity", "affinity").inc()
            picks = [h or p for h, p in zip(held, picks, strict=True)]
        keep_local = first.stages != [Stage.ENCODE]
        remote: dict[str, list[str]] = {}
        local: dict[str, str] = {}
        for h, inst in zip(hashes, picks, strict=True):
            self.affinity.remember(h, inst.url)
            if inst is prefill.instance:
                local[h] = images[h]
            else:
                remote.setdefault(inst.url, []).append(h)
        by_url = {i.url: i for i in picks}
        results = await asyncio.gather(*(
            self._encode_only(req, by_url[url], {h: images[h] for h in hs}, mm_items, touched)
            for url, hs in remote.items()))
        sources = [s for group in results for s in group]
        rest = hops if keep_local else hops[1:]
        if local and Stage.ENCODE not in prefill.stages:
            prefill.stages.insert(0, Stage.ENCODE)
        return rest, local, sources

    async def _encode_only(self, req: GenerationRequest, inst: Instance, images: dict[str, str],
                           mm_items: list[MMItemSpec], touched: set[str]) -> list[MMSource]:
        items = [m for m in mm_items if m.content_hash in images]
        sreq = StageRequest(request_id=req.request_id + ENCODE_ID_SUFFIX, stages=[Stage.ENCODE],
                            prompt_token_ids=req.prompt_token_ids, mm_items=items, images=images,
                            sampling=req.sampling, timeout_s=self.config.stage_timeout_s)
        touched.add(inst.url)
        async for event in self._stream(inst, sreq):
            if isinstance(event, EncodedEvent):
                return [MMSource(content_hash=e.content_hash, num_tokens=e.num_tokens, handle=e.handle)
                        for e in event.items]
        raise StageFailure(inst, f"{inst.url} ended the encode stage without a hand-over")

    async def _stream(self, inst: Instance, sreq: StageRequest) -> AsyncIterator[object]:
        """POST /internal/run and yield its parsed events; transport trouble is a StageFailure."""
        timeout = httpx.Timeout(connect=5.0, read=self.config.stage_timeout_s, write=30.0, pool=5.0)
        inst.inflight += 1
        started = time.monotonic()
        label = "".join(s.value[0].upper() for s in sreq.stages)
        outcome = "error"
        try:
            async with self.client.stream("POST", f"{inst.url}/internal/run", content=sreq.model_dump_json(),
                                          headers={"content-type": "application/json"},
                                          timeout=timeout) as resp:
                if resp.status_code >= 400:
                    body = (await resp.aread()).decode(errors="replace")
                    if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                        raise BackendError(resp.status_code, _error_message(body))
                    raise StageFailure(inst, f"{inst.url} answered {resp.status_code}: {body[:200]}",
                                       status=503 if resp.status_code in (429, 503) else 502)
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    event = _parse_event(line)
                    if isinstance(event, ErrorEvent):
                        if 400 <= event.status < 500:
                            raise BackendError(event.status, event.message)
                        raise StageFailure(inst, f"{inst.url}: {event.message}", status=event.status)
                    yield event
            outcome = "ok"
        except StageFailure as failure:
            failure.stage = failure.stage or sreq.stages[0]
            raise
        except httpx.TimeoutException as exc:
            raise StageFailure(inst, f"{inst.url} timed out after {time.monotonic() - started:.1f}s",
                               status=504, stage=sreq.stages[0]) from exc
        except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
            raise StageFailure(inst, f"{inst.url} failed: {type(exc).__name__}: {exc}",
                               stage=sreq.stages[0]) from exc
        finally:
            inst.inflight -= 1
            self.metrics.hop_seconds.labels(label, outcome).observe(time.monotonic() - started)

    async def _abort(self, request_ids: list[str], urls: set[str]) -> None:
        """Best effort: tell every instance the request touched to drop it (under each id its
        attempts used) and free its blocks."""
        async def one(url: str, request_id: str) -> None:
            try:
                await self.client.post(f"{url}/internal/abort/{request_id}", timeout=self.config.abort_timeout_s)
            except httpx.HTTPError as exc:
                log.debug("abort of %s on %s failed: %s", request_id, url, exc)

        ids = [i + suffix for i in request_ids for suffix in ("", ENCODE_ID_SUFFIX)]
        await asyncio.shield(asyncio.gather(*(one(u, i) for u in urls for i in ids)))


class AffinityIndex:
    """Which instance last encoded each image (by content hash): its MM cache likely still
    holds the embedding, so sending the image there again costs a pull, not an encode."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def remember(self, content_hash: str, url: str) -> None:
        self._where[content_hash] = url
        self._where.move_to_end(content_hash)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def holder(self, content_hash: str, registry: Registry, excluded: set[str]) -> Instance | None:
        url = self._where.get(content_hash)
        if url is None or url in excluded:
            return None
        inst = registry.instances.get(url)
        return inst if inst is not None and inst.can_run(Stage.ENCODE) else None


def _parse_event(line: str) -> object:
    data = json.loads(line)
    return _EVENT_TYPES[data["type"]].model_validate(data)


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
        return data.get("error", {}).get("message") or data.get("message") or body
    except ValueError:
        return body
