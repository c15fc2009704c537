"""n > 1 choices from one prefill (OpenAI's `n`, vLLM's `best_of`).

The prompt is prefilled once; the prefill samples the first token of every choice from
the same logits, each with its own seed stream (`SamplingParams.for_choice`;
model_runner.py). Where the decode runs, the prompt's KV is forked: every live choice but
one gets a copy of the prompt's blocks (`Engine.fork_kv`), and each choice decodes as a
request of its own (`<id>.c<i>`). Their events are merged into the run's one stream,
tagged with the choice index; the run ends when every choice has finished.

- A prefill-only run (P, EP) is a plain run: its hand-over carries the n first tokens
  (`KVSource.choices`) and the decode instance forks after pulling the KV once.
- A run that prefills and decodes here (EPD, PD, EP+D on one instance) prefills as a
  prefill-only request, then forks the parked KV locally and releases it.
- A decode-only run forks the KV it pulled.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from triptych.sampling_params import SamplingParams
from triptych.stage_protocol import (
    ErrorEvent,
    FinishedEvent,
    MigratingEvent,
    StageRequest,
    TokenLogprob,
    TokensEvent,
)
from triptych.topology import Stage
from triptych.worker import stage_run
from triptych.worker.engine.kv_cache import OutOfBlocksError
from triptych.worker.engine.request import PrefilledKV, Request, RequestValidationError
from triptych.worker.errors import http_status
from triptych.worker.instance import InstanceRuntime

Start = tuple[int, TokenLogprob | None]  # a choice's first token and its log-prob entry


def first_token_ends(token: int, params: SamplingParams, eos_ids: frozenset[int], num_tokens: int,
                     max_model_len: int) -> str | None:
    """The finish reason when a choice's first token already ends it (as the engine decides)."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if params.max_tokens <= 1 or num_tokens + 1 >= max_model_len:
        return "length"
    return None


async def stream(inst: InstanceRuntime, sreq: StageRequest, req: Request, reserved: list[Any]
                 ) -> AsyncIterator[bytes]:
    """`stage_run.stream` for a request with n > 1 choices."""
    if Stage.DECODE not in sreq.stages:
        async for line in stage_run.stream(inst, sreq, req, reserved):
            yield line
        return
    engine = inst.engine
    assert engine is not None
    inst.inflight += 1
    try:
        if req.prefilled is not None:  # decode-only: the KV pulled from the prefill instance
            kv = sreq.kv_source
            assert kv is not None
            pre = req.prefilled
            starts: list[Start] = [(kv.first_token, kv.first_logprob), *((c.token, c.logprob) for c in kv.choices)]
            async for line in _fork(inst, sreq, starts, pre.block_ids, pre.num_tokens, owned=True,
                                    announce=False, seed=sreq.sampling.seed):
                yield line
            return
        prefilled = None
        async for item in _prefill_here(inst, sreq, req, reserved):
            if isinstance(item, bytes):
                yield item
            else:
                prefilled = item
        if prefilled is None:
            return
        starts, block_ids, num_tokens = prefilled
        try:
            async for line in _fork(inst, sreq, starts, block_ids, num_tokens, owned=False, announce=True,
                                    seed=req.seed):
                yield line
        finally:
            engine.release(req.request_id)  # the copies are made: the parked prompt KV goes
    finally:
        inst.inflight -= 1


async def _prefill_here(inst: InstanceRuntime, sreq: StageRequest, req: Request, reserved: list[Any]
                        ) -> AsyncIterator[bytes | tuple[list[Start], list[int], int]]:
    """Run the prompt as a prefill-only request: error lines, or (starts, blocks, tokens)."""
    engine, migration = inst.engine, inst.migration
    assert engine is not None and migration is not None
    req.stages = frozenset(req.stages - {Stage.DECODE})
    try:
        async for out in engine.generate(req, timeout_s=sreq.timeout_s):
            if reserved:
                migration.release_embeddings(reserved)
                reserved = []
            if out.error or (out.finished and out.handoff is None):
                status = 500 if not out.error else stage_run.engine_failure_status(out)
                yield _line(ErrorEvent(status=status, message=out.error or "the prefill ended without its KV"))
                return
            if out.finished and out.handoff is not None:
                first = out.handoff.first_token
                assert first is not None
                lp = TokenLogprob.model_validate(out.logprobs[-1]) if out.logprobs else None
                more = [(t, TokenLogprob.model_validate(e) if e else None) for t, e in req.choice_firsts]
                yield ([(first, lp), *more], list(out.handoff.kv_block_ids), out.handoff.num_kv_tokens)
    except RequestValidationError as exc:
        yield _line(ErrorEvent(status=http_status(exc), message=str(exc)))
    except TimeoutError:
        yield _line(ErrorEvent(status=504, message=f"request exceeded {sreq.timeout_s}s"))
    finally:
        migration.release_embeddings(reserved)


async def _fork(inst: InstanceRuntime, sreq: StageRequest, starts: list[Start], block_ids: list[int],
                num_tokens: int, *, owned: bool, announce: bool, seed: int | None) -> AsyncIterator[bytes]:
    """One decode per live choice over a copy of the prompt's KV (`owned`: the blocks are
    this run's, the last live choice takes them). `announce`: the first tokens were not
    streamed yet (the prefill ran here)."""
    engine = inst.engine
    assert engine is not None
    params = sreq.sampling
    if seed is None and not params.greedy:
        seed = random.getrandbits(63)  # unseeded: still one stream per choice
    try:
        guides = await _choice_guides(engine, sreq.grammar, starts)
    except RequestValidationError as exc:
        if owned:
            engine.free_kv(block_ids)
        yield _line(ErrorEvent(status=http_status(exc), message=str(exc)))
        return
    live: list[int] = []
    for i, (token, lp) in enumerate(starts):
        if announce:
            yield _line(TokensEvent(token_ids=[token], logprobs=[lp] if lp is not None else None, index=i))
        reason = first_token_ends(token, params, engine.eos_ids, num_tokens, engine.max_model_len)
        if reason is None and guides[i] is not None and guides[i].finished:
            reason = "stop"  # the grammar accepted the first token and nothing can follow
        if reason is not None:
            yield _line(FinishedEvent(finish_reason=reason, index=i))
        else:
            live.append(i)
    children: list[tuple[int, StageRequest, Request]] = []
    try:
        for j, i in enumerate(live):
            blocks = block_ids if owned and j == len(live) - 1 else engine.fork_kv(block_ids, num_tokens)
            child = sreq.model_copy(update={"request_id": f"{sreq.request_id}.c{i}", "stages": [Stage.DECODE],
                                            "sampling": params.for_choice(i, seed)})
            children.append((i, child, Request(child.request_id, child.prompt_token_ids, child.sampling,
                                               mm_items=child.mm_items, stages=frozenset({Stage.DECODE}),
                                               prefilled=PrefilledKV(blocks, num_tokens, starts[i][0]),
                                               grammar=child.grammar, stream_interval=child.stream_interval)))
            children[-1][2].guide = guides[i]
    except BaseException as exc:
        for _, _, child_req in children:
            engine.free_kv(child_req.prefilled.block_ids)  # type: ignore[union-attr]
        if owned and (not live or len(children) < len(live)):
            engine.free_kv(block_ids)
        if not isinstance(exc, OutOfBlocksError):
            raise
        yield _line(ErrorEvent(status=503, message=f"KV cache exhausted forking {len(live)} choices: {exc}"))
        return
    if owned and not live:
        engine.free_kv(block_ids)
    async for line in _merge(inst, children):
        yield line


async def _choice_guides(engine: Any, grammar: str | None, starts: list[Start]) -> list[Any]:
    """Each choice's own grammar matcher (guided.py), replayed from its own first token: the
    choices share the grammar, not the state. Built in worker threads (see stage_run.build_guide)."""
    if grammar is None or engine.language is None:
        return [None] * len(starts)
    guides = engine.admission.guides
    return list(await asyncio.gather(*(asyncio.to_thread(guides.matcher, grammar, [token])
                                       for token, _ in starts)))


async def _merge(inst: InstanceRuntime, children: list[tuple[int, StageRequest, Request]]) -> AsyncIterator[bytes]:
    """Run the choices' decodes concurrently; their events, tagged with the choice, as they come."""
    engine, migration = inst.engine, inst.migration
    assert engine is not None and migration is not None
    queue: asyncio.Queue[BaseModel | None] = asyncio.Queue()

    async def run(index: int, child: StageRequest, req: Request) -> None:
        skip = 1
        try:
            async for out in engine.generate(req, timeout_s=child.timeout_s):
                for event in stage_run.events_for(migration, child, out, skip, req, engine, precopy=False):
                    if isinstance(event, TokensEvent | FinishedEvent | MigratingEvent):
                        event.index = index
                    queue.put_nowait(event)
                skip = max(0, skip - len(out.new_token_ids))
        except RequestValidationError as exc:
            queue.put_nowait(ErrorEvent(status=http_status(exc), message=str(exc)))
        except TimeoutError:
            queue.put_nowait(ErrorEvent(status=504, message=f"request exceeded {child.timeout_s}s"))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(run(i, child, req)) for i, child, req in children]
    try:
        remaining = len(tasks)
        while remaining:
            event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield _line(event)
    finally:
        for task in tasks:
            task.cancel()  # leaving engine.generate early aborts the choice
        await asyncio.gather(*tasks, return_exceptions=True)


def _line(event: BaseModel) -> bytes:
    return (event.model_dump_json() + "\n").encode()
