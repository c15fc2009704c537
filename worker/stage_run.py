"""One run of a request's stages on this instance (triptych/stage_protocol.py).

Before the engine sees the request, `prepare` pulls what earlier stages left elsewhere
(HydraInfer §4.3, steps 2-4, through the migration service): image embeddings into this
instance's MM cache, or a prefilled KV cache into its KV cache. `stream` then turns the
engine's outputs into NDJSON events; when this instance's last stage ends before decode
completes, the request is parked and its blocks are offered to the next instance.
Failures are typed; `errors.http_status` decides their status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from typing import Any

from pydantic import BaseModel

from triptych.stage_protocol import (
    ChoiceStart,
    EncodedEvent,
    ErrorEvent,
    FinishedEvent,
    MigratingEvent,
    PrecopyEvent,
    PrefilledEvent,
    StageRequest,
    TokenLogprob,
    TokensEvent,
    encode_stage_event,
    encode_tokens_line,
)
from triptych.topology import Stage
from triptych.worker.admission import decode_payload, vision_inputs
from triptych.worker.engine.request import PrefilledKV, Request, RequestOutput, RequestValidationError
from triptych.worker.errors import NotServingError, engine_failure_status, http_status

__all__ = ["engine_failure_status", "events_for", "prepare", "stream"]
from triptych.worker import takeover
from triptych.worker.instance import InstanceRuntime
from triptych.worker.metrics import observe_stages
from triptych.worker.migration import MigrationService


async def prepare(inst: InstanceRuntime, sreq: StageRequest) -> tuple[Request, list[Any]]:
    """Check the instance runs the request's stages, decode its images and pull its
    embeddings / KV. Returns the request and the MM entries to release once the engine
    holds its own references. Raises the typed errors of worker/errors.py."""
    engine, migration = inst.engine, inst.migration
    if engine is None or migration is None or inst.draining or inst.switching:
        raise NotServingError(f"instance {inst.settings.instance_id} is {inst.status}; not accepting work")
    missing = [s.value for s in sreq.stages if not engine.role.runs(s)]
    if missing:
        raise NotServingError(f"instance role {engine.role.value} does not run stage(s) {', '.join(missing)}")
    # A role switch waits for runs still pulling their inputs: their sources free what they pull.
    inst.preparing += 1
    try:
        return await _pull_inputs(inst, engine, migration, sreq)
    finally:
        inst.preparing -= 1


async def _pull_inputs(inst: InstanceRuntime, engine: Any, migration: MigrationService,
                       sreq: StageRequest) -> tuple[Request, list[Any]]:
    # Image work first (nothing is reserved yet), on the decode pool: off the event loop.
    images = await inst.decode_pool.run(decode_payload, sreq.images, sreq.mm_items) if sreq.images else {}
    vins: dict[str, Any] = {}
    if images and Stage.ENCODE in sreq.stages and engine.vision is not None:
        vins = await inst.decode_pool.run(vision_inputs, engine.vision, engine.config.max_image_pixels,
                                          sreq.mm_items, images)
    reserved = await migration.pull_embeddings(sreq.mm_sources) if sreq.mm_sources else []
    prefilled = pull = None
    try:
        if sreq.kv_source is not None:
            src = sreq.kv_source
            # The READ runs in a transfer thread while the request is admitted here (its
            # grammar compiled, its positions computed): the engine takes it the moment its
            # blocks land. The tokens let the pull skip blocks this instance's prefix cache
            # already holds: a shared prompt prefix, or a migrated decode's blocks pre-copied here.
            pull = asyncio.ensure_future(migration.pull_kv(src, [*sreq.prompt_token_ids, *src.generated],
                                                           sreq.mm_items))
            await asyncio.sleep(0)  # the pull reserves its blocks and hands the READ to its thread
            prefilled = PrefilledKV(block_ids=[], num_tokens=src.num_tokens, first_token=src.first_token,
                                    generated=list(src.generated))
        req = Request(sreq.request_id, sreq.prompt_token_ids, sreq.sampling, mm_items=sreq.mm_items,
                      images=images, stages=frozenset(sreq.stages), prefilled=prefilled,
                      grammar=sreq.grammar, stream_interval=sreq.stream_interval)
        req.vision_inputs.update(vins)  # the engine's admission skips what is ready here
        # Make-before-break (token_feed.py): a decode that both instances would sample the
        # same way moves live; a takeover here is fed its source's tokens.
        req.moves_live = inst.settings.live_handover and Stage.DECODE in sreq.stages and sreq.sampling.n == 1 and (
            sreq.sampling.greedy or sreq.sampling.seed is not None)
        req.feed = inst.feeds.get(sreq.request_id)
        await _decode_videos(inst, sreq, req)
        await build_guide(engine, req)
        if pull is not None:
            engine.admission.prepare(req)
            assert prefilled is not None
            prefilled.block_ids = await asyncio.shield(pull)  # a cancelled run lets the READ end first
    except BaseException:
        migration.release_embeddings(reserved)
        if pull is not None:
            await _discard_pull(pull, migration)
        raise
    return req, reserved


async def _discard_pull(pull: asyncio.Future[list[int]], migration: MigrationService) -> None:
    """Free the blocks a KV pull reserved for a run that failed, once its READ has ended: a
    READ still writing into blocks must not see them handed to another request. A pull
    that failed freed its own blocks."""
    try:
        block_ids = await asyncio.shield(pull)
    except BaseException:
        if not pull.done():  # cancelled again while waiting: free them when it ends
            pull.add_done_callback(partial(_discard_done, migration))
        return
    migration.discard_kv(block_ids)


def _discard_done(migration: MigrationService, pull: asyncio.Future[list[int]]) -> None:
    if not pull.cancelled() and pull.exception() is None:
        migration.discard_kv(pull.result())


async def _decode_videos(inst: InstanceRuntime, sreq: StageRequest, req: Request) -> None:
    """Decode and patchify the videos this run encodes in a worker thread (decoding takes
    far longer than an image's: it must not stall the event loop); admission then finds
    their vision inputs ready. Typed errors: a bad video is a 400."""
    if Stage.ENCODE not in req.stages or inst.engine is None:
        return
    videos = inst.engine.admission.videos
    await _decode_frame_videos(inst, req)
    for item in req.mm_items:
        h = item.content_hash
        if item.kind != "video" or h in req.vision_inputs:
            continue
        if not item.video_parts and videos_cached(inst, h):
            continue  # sent to the instance whose MM cache holds it (router cache affinity): no decode

        if item.video_parts and h not in req.images:  # decoded on V instances: pull the patches
            assert inst.transfer is not None
            rows, grid = await asyncio.to_thread(inst.video_puller.pull, inst.transfer, item.video_parts,
                                                 videos.patch_dim, inst.settings.pull_timeout_s)
            req.vision_inputs[h] = videos.from_parts(rows, grid, item)
        elif h in req.images:
            req.vision_inputs[h] = await asyncio.to_thread(videos.prepare, req.images[h], item)


async def _decode_frame_videos(inst: InstanceRuntime, req: Request) -> None:
    """Videos taken as images (LLaVA): each video is decoded (or its V parts pulled) once,
    as a video is, and its sampled frames become the inputs of its frame items."""
    assert inst.engine is not None
    videos = inst.engine.admission.videos
    groups: dict[str, list[Any]] = {}
    for item in req.mm_items:
        if item.frame is not None and item.content_hash not in req.vision_inputs:
            groups.setdefault(item.frame.video, []).append(item)
    for key, items in groups.items():
        parts = next((it.video_parts for it in items if it.video_parts), None)
        if parts is None and all(videos_cached(inst, it.content_hash) for it in items):
            continue  # sent to the instance whose MM cache holds its frames: no decode
        if parts is not None and key not in req.images:  # decoded on V instances: pull the frames
            assert inst.transfer is not None
            rows, grid = await asyncio.to_thread(inst.video_puller.pull, inst.transfer, parts,
                                                 videos.patch_dim, inst.settings.pull_timeout_s)
            frames = videos.frames_from_parts(rows, grid)
            req.vision_inputs.update(await asyncio.to_thread(videos.frame_inputs, frames, items))
        elif key in req.images:
            req.vision_inputs.update(await asyncio.to_thread(videos.prepare_frames, req.images[key], items))


def videos_cached(inst: InstanceRuntime, content_hash: str) -> bool:
    engine = inst.engine
    return engine is not None and engine.admission.holds_embedding(content_hash)


async def build_guide(engine: Any, req: Request) -> None:
    """Compile the request's grammar (and the tokenizer index, once) in a worker thread: a
    large schema takes a while, and the event loop serves every other stream meanwhile.
    Admission finds the matcher ready; a grammar error is a 400 (guided.GrammarError)."""
    if req.grammar is None or engine.language is None or Stage.DECODE not in req.stages \
            and Stage.PREFILL not in req.stages:
        return
    pre = req.prefilled
    replay = [*pre.generated, pre.first_token] if pre is not None else []
    req.guide = await asyncio.to_thread(engine.admission.guides.matcher, req.grammar, replay)


def _tokens_event(tokens: list[int], out: RequestOutput, req: Request | None = None) -> TokensEvent:
    """The new tokens, with their log-probs when the request asked for them. The engine
    computes log-probs only for tokens it sampled, so they line up with `tokens` (the
    tokens of earlier instances are skipped). A fed decode's tokens carry their index."""
    lps = out.logprobs[-len(tokens):] if out.logprobs else None
    start = out.num_output_tokens - len(tokens) if req is not None and req.feed is not None else None
    return TokensEvent(token_ids=tokens, logprobs=[TokenLogprob.model_validate(e) for e in lps]
                       if lps and len(lps) == len(tokens) else None, start=start)


def events_for(migration: MigrationService, sreq: StageRequest, out: RequestOutput, skip: int,
               req: Request | None = None, engine: Any = None, precopy: bool = True) -> list[BaseModel]:
    """The stage events of one engine output (`req`: for an n > 1 prefill's other first
    tokens; `engine`: to hold the full KV blocks of a pre-copy, unless not `precopy`)."""
    if out.precopy:
        events = events_for(migration, sreq, replace(out, precopy=False), skip, req)
        return events + _precopy(migration, sreq, engine, precopy)
    if out.error:  # bad input was refused at add_request (400); what fails later is ours
        return [ErrorEvent(status=engine_failure_status(out), message=out.error)]
    handoff = out.handoff
    if handoff is not None and handoff.stage == Stage.ENCODE:
        return [EncodedEvent(items=migration.offer_embeddings(sreq.request_id, handoff.mm))]
    if handoff is not None and handoff.stage == Stage.PREFILL:
        assert handoff.first_token is not None
        kv = migration.offer_kv(sreq.request_id, handoff.kv_block_ids, handoff.num_kv_tokens, handoff.first_token)
        if out.logprobs:
            kv.first_logprob = TokenLogprob.model_validate(out.logprobs[-1])
        if req is not None and req.choice_firsts:
            kv.choices = [ChoiceStart(token=t, logprob=TokenLogprob.model_validate(e) if e else None)
                          for t, e in req.choice_firsts]
        return [PrefilledEvent(kv=kv)]
    if handoff is not None and handoff.stage == Stage.DECODE and handoff.held is not None:
        # Handed over live (make-before-break): the lease owns the held references, and the
        # decode's tokens keep coming on this stream until the router closes it.
        tokens = out.new_token_ids[skip:]
        return ([_tokens_event(tokens, out, req)] if tokens else []) + [
            MigratingEvent(kv=migration.offer_precopy(sreq.request_id, handoff.held), live=True)]
    if handoff is not None and handoff.stage == Stage.DECODE:  # migrated out (role switch, drain)
        assert handoff.first_token is not None
        kv = migration.offer_kv(sreq.request_id, handoff.kv_block_ids, handoff.num_kv_tokens, handoff.first_token)
        kv.generated = list(handoff.generated)
        tokens = out.new_token_ids[skip:]
        return ([_tokens_event(tokens, out)] if tokens else []) + [MigratingEvent(kv=kv)]
    events: list[BaseModel] = []
    tokens = out.new_token_ids[skip:]
    if tokens:
        events.append(_tokens_event(tokens, out, req))
    if out.finished:
        reason = out.finish_reason.value if out.finish_reason else "abort"
        events.append(FinishedEvent(finish_reason=reason, timings=out.timings or {}))
    return events


def _precopy(migration: MigrationService, sreq: StageRequest, engine: Any, allowed: bool) -> list[BaseModel]:
    """A decode about to be moved offers its full KV blocks for a pre-copy while it goes on
    here (live migration; the switch waits for the pull before it stops the decode). Not
    for the choices of an n > 1 request (`allowed` False: they move as before), nor a
    decode with no full block yet."""
    if engine is None:
        return []
    if not allowed:
        engine.skip_precopy(sreq.request_id)
        return []
    held = engine.hold_full_kv(sreq.request_id)
    if held is None:
        return []
    return [PrecopyEvent(kv=migration.offer_precopy(sreq.request_id, held))]


def _plain(out: RequestOutput) -> bool:
    """Tokens and nothing else: no end, hand-off, pre-copy or log-probs."""
    return not (out.finished or out.error or out.handoff is not None or out.precopy or out.logprobs)


def _line(event: BaseModel) -> bytes:
    return encode_stage_event(event)


def _follows(last: TokensEvent, event: TokensEvent) -> bool:
    if last.start is None or event.start is None:
        return last.start is None and event.start is None
    return last.start + len(last.token_ids) == event.start


def merge_tokens(events: list[BaseModel]) -> list[BaseModel]:
    """Consecutive `tokens` events of one choice as one: a stream that fell behind the
    engine sends everything it owes in one event (one line to write, parse and render).
    Events with output indices (`start`) merge only where the second begins where the first
    ends: a takeover's tokens fed in between (token_feed.py) are not streamed."""
    merged: list[BaseModel] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TokensEvent) and isinstance(last, TokensEvent) and last.index == event.index \
                and (last.logprobs is None) == (event.logprobs is None) and _follows(last, event):
            merged[-1] = TokensEvent(token_ids=[*last.token_ids, *event.token_ids], index=event.index,
                                     logprobs=None if event.logprobs is None else [*(last.logprobs or []),
                                                                                   *event.logprobs],
                                     start=last.start)
        else:
            merged.append(event)
    return merged


async def stream(inst: InstanceRuntime, sreq: StageRequest, req: Request, reserved: list[Any],
                 write: Callable[[bytes], None] | None = None) -> AsyncIterator[bytes]:
    """The engine's outputs for `req` as NDJSON event lines; failures end it with an error
    event. With `write` (the run's event channel), its plain token lines after the first
    go there straight from the engine's per-step callback, ahead of anything still to come
    here (worker/engine/driver.py's direct take)."""
    engine, migration = inst.engine, inst.migration
    assert engine is not None and migration is not None
    # Tokens sampled (and streamed) before this instance: P's first token, and a migrated
    # decode's earlier tokens. By output index: tokens fed to a takeover (token_feed.py)
    # join the request unseen by this stream.
    streamed = 1 + len(req.prefilled.generated) if req.prefilled is not None else 0
    awaiting_first = sreq.stages == [Stage.DECODE]  # a decode hop: its first token ends a takeover's hop
    started = False  # the first batch went through here (it releases `reserved`)
    live = True

    def direct(outs: list[RequestOutput]) -> bool:
        if not (live and started and write is not None) or awaiting_first:
            return False
        tokens: list[int] = []
        for out in outs:
            if not _plain(out) or out.num_output_tokens - len(out.new_token_ids) < streamed:
                return False
            tokens += out.new_token_ids
        if tokens:
            write(encode_tokens_line(tokens))
        return True

    if awaiting_first:
        takeover.mark(inst, sreq.request_id, "admitted_at")
    inst.inflight += 1
    try:
        if req.feed is not None:  # a live takeover, its KV pulled: the router may cut over now
            yield _line(TokensEvent(token_ids=[], start=streamed))
        fast = direct if write is not None and req.feed is None else None
        async for batch in engine.generate_batches(req, timeout_s=sreq.timeout_s, direct=fast):
            started = True
            if reserved:  # the request now holds its own references to pulled embeddings
                migration.release_embeddings(reserved)
                reserved = []
            events: list[BaseModel] = []
            for out in batch:
                skip = max(0, streamed - (out.num_output_tokens - len(out.new_token_ids)))
                events += events_for(migration, sreq, out, skip, req, engine)
                if out.finished and out.timings:
                    observe_stages(engine.role.value, set(sreq.stages), out.timings)
            if awaiting_first and any(isinstance(e, TokensEvent) for e in events):
                awaiting_first = False
                takeover.mark(inst, sreq.request_id, "first_token_at")
            yield b"".join(_line(event) for event in merge_tokens(events))
    except RequestValidationError as exc:
        yield _line(ErrorEvent(status=http_status(exc), message=str(exc)))
    except TimeoutError as exc:
        yield _line(ErrorEvent(status=http_status(exc), message=f"request exceeded {sreq.timeout_s}s"))
    finally:
        live = False
        migration.release_embeddings(reserved)
        inst.inflight -= 1
        inst.feeds.pop(sreq.request_id, None)
